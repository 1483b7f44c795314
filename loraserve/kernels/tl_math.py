"""Small Triton device functions shared by the kernels."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def tanh(x, LIBDEVICE: tl.constexpr):
    """tanh of an fp32 tensor: CUDA's tanhf where libdevice exists, else 1 - 2 / (exp(2x) + 1) on x clipped to
    [-15, 15], where tanh is +-1 in fp32 (Triton's interpreter has no libdevice; within a few fp32 ulps)."""
    if LIBDEVICE:
        return libdevice.tanh(x)
    else:
        return 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(x, -15.0), 15.0)) + 1.0)
