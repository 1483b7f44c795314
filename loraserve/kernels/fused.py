"""Fused elementwise Triton kernels of the decoder layer, one launch each.

- ``rms_norm``: optional residual add + RMSNorm (HF numerics), Llama's ``w * x`` or Gemma's
  ``(1 + w) * x`` (``unit_offset``), optionally after a first norm of x alone (Gemma's post-attention and
  post-feedforward norms, ``pre_weight``);
- ``silu_and_mul`` / ``gelu_tanh_and_mul``: ``act(gate) * up`` on the packed gate/up output;
- ``rotary_and_cache``: rotate-half rotary on q and k (optionally after a per-head RMSNorm of each, Qwen3
  and Gemma 3), plus the K/V cache write.

Each takes an optional ``delta`` of its input (float32 or the model dtype; the
LoRA delta of the projection before it: models.linear.LinearOutput), added
first: the input becomes ``round(input + delta)`` in the model dtype.

Semantics match ``fused_reference`` (see each function for the rounding).
Inputs may be strided views whose last dim is contiguous; outputs are new
``torch.empty`` tensors, so every function can be captured in a CUDA graph.
Kernels launch with ``enable_fp_fusion=False``: no FMA contraction, so each
op rounds where torch's does. On Hopper they are programmatic dependent
launches that wait for the kernel before them first thing: only the launch
overlaps that kernel's end.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from loraserve.kernels.fused_reference import QKNorm
from loraserve.kernels.launch import CachedLauncher, cdiv, next_power_of_2, pdl_launch
from loraserve.kernels.lora_expand import LoRAFactors, pipelined_shape
from loraserve.kernels.lora_meta import PAGE_RANK
from loraserve.kernels.lora_shrink import dot_precision, slot_of_tile, slot_work, token_programs
from loraserve.kernels.tl_math import tanh

_SILU_BLOCK = 1024
_ROTARY_TILE = 512  # elements of one rotary program's [heads, hd/2] tile


@triton.jit
def _weighted(xf, rstd, w, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """The normalized fp32 row xf * rstd times its fp32 weight w, in fp32: as Gemma computes it, xf * rstd * (1 + w);
    else as Llama does, w * (xf * rstd rounded to dtype)."""
    if UNIT_OFFSET:
        y = xf * rstd * (1.0 + w)
    else:
        y = w * (xf * rstd).to(dtype).to(tl.float32)
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_delta, stride_res, stride_out, stride_res_out,
    dim, inv_dim, eps,
    HAS_DELTA: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    pre_w_ptr, PRE_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """One program per row: x (rounded to the residual's dtype first: it may be a row-parallel fp32 sum)
    (+ delta, rounded), (PRE_NORM: x = norm(x) with pre_w, rounded),
    s = x (+ residual, rounded), out = w * (s * rsqrt(mean(s^2) + eps)).to(dtype)
    (UNIT_OFFSET: out = ((s * rsqrt(mean(s^2) + eps)) * (1 + w)).to(dtype), all in fp32)."""
    if PDL:  # launched early: wait for the kernel before it (it wrote x) before anything else
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK_D]
    if HAS_RESIDUAL:
        dtype = res_ptr.dtype.element_ty
    else:
        dtype = x.dtype
    xf = x.to(dtype).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_D]
        xf = (xf + d).to(dtype).to(tl.float32)
    if PRE_NORM:
        rstd0 = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_dim + eps)
        w0 = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        xf = _weighted(xf, rstd0, w0, dtype, UNIT_OFFSET).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (xf + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        xf = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_dim + eps)  # torch's mean multiplies by fp32(1/D)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _weighted(xf, rstd, w, dtype, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm_launch = CachedLauncher(_rms_norm_kernel)


def with_columns(rows: int, width: int, columns: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized [rows, width] tensor whose rows have `columns` more columns of room after width (a view
    of [rows, width + columns]): where the next LoRA layer puts its step's products (lora/layers.py)."""
    return torch.empty((rows, width + columns), dtype=dtype, device=device)[:, :width]


def rms_norm(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D]
    x_delta: torch.Tensor | None = None,  # [T, D] float32 or x's dtype
    pre_weight: torch.Tensor | None = None,  # [D]: x is first normalized with this weight (before the residual)
    unit_offset: bool = False,  # Gemma: (1 + w) * x in fp32, rounded once
    columns: int = 0,  # out's rows have this many more columns of room after D (lora/layers.py: input_columns)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T, D], new residual [T, D] or None) in one launch; see ``rms_norm_ref``.

    With a residual, ``s = x + residual`` is computed in fp32, rounded to
    the residual's dtype and returned as the new residual; the norm is taken of ``s``.
    x may then be float32 (a row-parallel layer's unrounded sum): it is rounded
    to the residual's dtype first. The output dtype is ``promote_types(dtype,
    weight.dtype)`` as in torch (``dtype`` with ``unit_offset``, as Gemma's
    ``type_as``), ``dtype`` the residual's (without one, x's).
    Every op rounds as torch's does except the fp32 sum of squares, whose
    order differs: rstd may differ in its last bits, so the normalized value
    can be one ulp off the reference (rarely), and the output after the weight
    multiply within two ulps.
    """
    num_tokens, dim = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape == (dim,)
    assert pre_weight is None or (pre_weight.is_contiguous() and pre_weight.shape == (dim,))
    dtype = x.dtype if residual is None else residual.dtype  # the model's: x may be an fp32 sum to round first
    out_dtype = dtype if unit_offset else torch.promote_types(dtype, weight.dtype)
    out = with_columns(num_tokens, dim, columns, out_dtype, x.device)
    res_out = None
    if x_delta is not None:
        assert x_delta.shape == x.shape and x_delta.stride(-1) == 1 and x_delta.dtype in (torch.float32, dtype)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        assert x.dtype in (dtype, torch.float32), f"x in {x.dtype} with a residual in {dtype}"
        res_out = torch.empty((num_tokens, dim), dtype=dtype, device=x.device)
    if num_tokens == 0:
        return out, res_out
    block_d = next_power_of_2(dim)
    num_warps = 4 if block_d <= 1024 else (8 if block_d <= 4096 else 16)
    res_in = x if residual is None else residual
    res_dst = out if res_out is None else res_out
    delta = x if x_delta is None else x_delta
    _rms_norm_launch((num_tokens,),
        x, delta, res_in, weight, out, res_dst,
        x.stride(0), delta.stride(0), res_in.stride(0), out.stride(0), res_dst.stride(0),
        dim, 1.0 / dim, eps,
        HAS_DELTA=x_delta is not None, HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, num_warps=num_warps,
        enable_fp_fusion=False,
        pre_w_ptr=weight if pre_weight is None else pre_weight, PRE_NORM=pre_weight is not None,
        UNIT_OFFSET=unit_offset, **pdl_launch(x),
    )
    return out, res_out


@triton.jit
def _gelu_tanh(g, LIBDEVICE: tl.constexpr):
    """GeLU's tanh approximation of fp32 g, as torch computes it: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    return 0.5 * g * (1.0 + tanh(inner, LIBDEVICE))


@triton.jit
def _activation(gate, LIBDEVICE_EXP: tl.constexpr, GELU_TANH: tl.constexpr):
    """The MLP's activation of `gate` computed in fp32 and rounded to gate's dtype (returned as fp32): GeLU-tanh, or
    silu as torch computes it, g / (1 + exp(-g)) with CUDA's expf and IEEE division."""
    g = gate.to(tl.float32)
    if GELU_TANH:
        act = _gelu_tanh(g, LIBDEVICE_EXP)
    else:
        if LIBDEVICE_EXP:  # CUDA's expf, as torch's silu uses
            e = libdevice.exp(-g)
        else:  # Triton's interpreter has no libdevice
            e = tl.exp(-g)
        act = tl.math.div_rn(g, 1.0 + e)
    return act.to(gate.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    in_ptr, delta_ptr, out_ptr, stride_in, stride_delta, stride_out, inter,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, PDL: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    """Program (row, block): out[row, cols] = round(round(silu(gate)) * up), silu in fp32
    (gate and up first rounded with their delta added)."""
    if PDL:  # launched early: wait for the kernel before it (it wrote gate_up) before anything else
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(in_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d_gate = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
        d_up = tl.load(delta_ptr + row * stride_delta + inter + cols, mask=mask, other=0.0).to(tl.float32)
        gate = (gate.to(tl.float32) + d_gate).to(gate.dtype)
        up = (up.to(tl.float32) + d_up).to(up.dtype)
    out = _activation(gate, LIBDEVICE_EXP, GELU_TANH) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


_silu_and_mul_launch = CachedLauncher(_silu_and_mul_kernel)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | LoRAFactors | None = None,
                 activation: str = "silu", columns: int = 0) -> torch.Tensor:
    """[T, 2I] (+ delta [T, 2I], float32 or the input dtype, or LoRA factors) -> [T, I]: ``silu(gate) * up``
    in one launch; see ``silu_and_mul_ref``. LoRA factors are expanded in the same launch, rounded to the
    input dtype before they are added (what their dense delta gives).

    silu is ``g / (1 + exp(-g))`` in fp32 (IEEE division, CUDA's ``expf`` via
    libdevice, as torch computes it) rounded to the input dtype, then the
    product is rounded: bit for bit with torch on the GPU. Triton's
    interpreter has no libdevice and uses ``tl.exp`` (within an fp32 ulp).
    ``activation="gelu_tanh"``: ``gelu_tanh_and_mul``. ``columns``: the output's rows have that many more
    columns of room after I (lora/layers.py: input_columns).
    """
    num_tokens, two_inter = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_inter % 2 == 0
    inter = two_inter // 2
    out = with_columns(num_tokens, inter, columns, gate_up.dtype, gate_up.device)
    if isinstance(delta, LoRAFactors):
        if num_tokens:
            _silu_and_mul_factors(gate_up, delta, out, gelu_tanh=activation == "gelu_tanh")
        return out
    if delta is not None:
        assert delta.shape == gate_up.shape and delta.stride(-1) == 1 and delta.dtype in (torch.float32, gate_up.dtype)
    if num_tokens == 0:
        return out
    grid = (num_tokens, cdiv(inter, _SILU_BLOCK))
    d = gate_up if delta is None else delta
    _silu_and_mul_launch(grid, gate_up, d, out, gate_up.stride(0), d.stride(0), out.stride(0), inter,
                         HAS_DELTA=delta is not None, BLOCK=_SILU_BLOCK, LIBDEVICE_EXP=gate_up.is_cuda, num_warps=4,
                         enable_fp_fusion=False, GELU_TANH=activation == "gelu_tanh", **pdl_launch(gate_up))
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | LoRAFactors | None = None,
                      columns: int = 0) -> torch.Tensor:
    """[T, 2I] (+ delta or LoRA factors, as silu_and_mul) -> [T, I]: ``gelu_tanh(gate) * up`` in one launch
    (Gemma's MLP); see ``gelu_tanh_and_mul_ref``. GeLU's tanh approximation is computed in fp32 (tanh: CUDA's
    ``tanhf``, or in the interpreter ``1 - 2 / (exp(2x) + 1)``) and rounded to the input dtype, then the
    product is rounded, as torch's ``gelu(approximate="tanh")`` and the multiply round."""
    return silu_and_mul(gate_up, delta, activation="gelu_tanh", columns=columns)


@triton.jit
def _factor_rows(offs_r, rank, page_row, tok, tok_ok, f_ptr, stride_ft, stride_fr, rank_width, b_ptr, stride_bp,
                 stride_br, PAGE: tl.constexpr):
    """For rank rows offs_r of a tile's adapter: which lie within its rank, the rows of B they are (from their
    pages), and the tile's gate and up factors of them ([BLOCK_M, len(offs_r)] float32)."""
    r_ok = offs_r < rank
    page = tl.load(page_row + offs_r // PAGE, mask=r_ok, other=0)  # page: [R]
    b_rows = b_ptr + page.to(tl.int64)[:, None] * stride_bp + (offs_r % PAGE)[:, None] * stride_br
    z_rows = f_ptr + tok[:, None] * stride_ft + offs_r[None, :] * stride_fr
    z_mask = tok_ok[:, None] & r_ok[None, :]
    z_gate = tl.load(z_rows, mask=z_mask, other=0.0)
    z_up = tl.load(z_rows + rank_width * stride_fr, mask=z_mask, other=0.0)
    return r_ok, b_rows, z_gate, z_up


@triton.jit
def _gate_up_products(r_ok, b_rows, z_gate, z_up, cols, inter, stride_bn, PRECISION: tl.constexpr):
    """The gate and up products [BLOCK_M, BLOCK_N] float32 at cols of those rank rows. The decode expand's numbers
    (lora_expand): float32 factors, B widened, its dot precision (factors rounded to bf16 for a bf16 dot took
    about 0.88x the time on an H200, but then the decode graphs and eager steps of
    tests/worker/test_lora_graphs_gpu.py gave logits 1.2 % of their scale apart, not 1 %)."""
    b_mask = r_ok[:, None] & (cols < inter)[None, :]
    b_gate = tl.load(b_rows + cols[None, :] * stride_bn, mask=b_mask, other=0.0)  # [R, BLOCK_N]
    b_up = tl.load(b_rows + (cols + inter)[None, :] * stride_bn, mask=b_mask, other=0.0)
    d_gate = tl.dot(z_gate, b_gate.to(tl.float32), input_precision=PRECISION)
    d_up = tl.dot(z_up, b_up.to(tl.float32), input_precision=PRECISION)
    return d_gate, d_up


@triton.jit
def _silu_lora_columns(in_ptr, out_ptr, stride_in, stride_out, inter, tok, tok_ok, rank, page_row,
                       f_ptr, stride_ft, stride_fr, rank_width, b_ptr, stride_bp, stride_br, stride_bn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, COL_TILES: tl.constexpr,
                       COL_STAGES: tl.constexpr, PRECISION: tl.constexpr, PAGE: tl.constexpr,
                       LIBDEVICE_EXP: tl.constexpr, GELU_TANH: tl.constexpr):
    """One token tile's COL_TILES column tiles of this program. COL_STAGES > 1: the tile's factors (its
    adapter's rank <= BLOCK_R of them) and pages loaded once, the column tiles' loads pipelined COL_STAGES deep;
    else each column tile takes the ranks in steps of BLOCK_R."""
    if COL_STAGES > 1:  # every rank in one step: pages and factors once for the tile
        r_ok, b_rows, z_gate, z_up = _factor_rows(tl.arange(0, BLOCK_R), rank, page_row, tok, tok_ok, f_ptr,
                                                  stride_ft, stride_fr, rank_width, b_ptr, stride_bp, stride_br,
                                                  PAGE)
    for j in tl.range(COL_TILES, num_stages=COL_STAGES):
        cols = (tl.program_id(0) * COL_TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)  # cols: [BLOCK_N]
        mask = tok_ok[:, None] & (cols < inter)[None, :]
        src = in_ptr + tok[:, None] * stride_in + cols[None, :]
        gate = tl.load(src, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_N]
        up = tl.load(src + inter, mask=mask, other=0.0)
        if COL_STAGES > 1:
            d_gate, d_up = _gate_up_products(r_ok, b_rows, z_gate, z_up, cols, inter, stride_bn, PRECISION)
        else:  # rank steps of BLOCK_R, pages and factors loaded for each column tile
            d_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            d_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r_ok, b_rows, z_gate, z_up = _factor_rows(r0 + tl.arange(0, BLOCK_R), rank, page_row, tok,
                                                          tok_ok, f_ptr, stride_ft, stride_fr, rank_width, b_ptr,
                                                          stride_bp, stride_br, PAGE)
                p_gate, p_up = _gate_up_products(r_ok, b_rows, z_gate, z_up, cols, inter, stride_bn, PRECISION)
                d_gate += p_gate
                d_up += p_up
        dtype = gate.dtype
        gate = (gate.to(tl.float32) + d_gate.to(dtype).to(tl.float32)).to(dtype)
        up = (up.to(tl.float32) + d_up.to(dtype).to(tl.float32)).to(dtype)
        act = _activation(gate, LIBDEVICE_EXP, GELU_TANH)
        tl.store(out_ptr + tok[:, None] * stride_out + cols[None, :], (act * up.to(tl.float32)).to(dtype),
                 mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _silu_and_mul_lora_kernel(
    in_ptr, out_ptr, stride_in, stride_out, num_tokens, inter,
    f_ptr, stride_ft, stride_fr, rank_width, b_ptr, stride_bp, stride_br, stride_bn,
    rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, map_ptr, page_ptr, stride_pa, num_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, COL_TILES: tl.constexpr,
    COL_STAGES: tl.constexpr, PRECISION: tl.constexpr, PAGE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    PDL: tl.constexpr, GELU_TANH: tl.constexpr,
):
    """Program (column-tile group, token-tile programs): as _silu_and_mul_kernel on tiles of one adapter's
    tokens (the step's tile map, as lora_expand walks it, base tokens included), gate and up first given
    their LoRA products, expanded here from the factors and rounded before they are added
    (_silu_lora_columns). With pipelined column tiles (COL_STAGES > 1) a tile whose adapter's rank is at most
    16 or 32 takes a dot of that width, not of all BLOCK_R ranks: factors wider than an adapter's rank (a pool
    whose max_lora_rank is larger) cost no more than its own."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    tile = tl.program_id(1)
    slot, m_tile = slot_of_tile(tile, map_ptr, num_tiles)
    while slot >= 0:
        next_slot, next_m_tile = slot_of_tile(tile + tl.num_programs(1), map_ptr, num_tiles)
        rank, count, start, adapter = slot_work(slot, rank_ptr, start_ptr, count_ptr, adapter_ptr)
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)  # tok: [BLOCK_M]
        tok_ok = (offs_m < count) & (tok >= 0) & (tok < num_tokens)
        tok = tok.to(tl.int64)
        page_row = page_ptr + tl.maximum(adapter, 0).to(tl.int64) * stride_pa
        # a call site per dot width (a constexpr); `and` after a constexpr False prunes the branch at compile time
        if COL_STAGES > 1 and BLOCK_R > 16 and rank <= 16:
            _silu_lora_columns(
                in_ptr, out_ptr, stride_in, stride_out, inter, tok, tok_ok, rank, page_row, f_ptr, stride_ft,
                stride_fr, rank_width, b_ptr, stride_bp, stride_br, stride_bn,
                BLOCK_M, BLOCK_N, 16, COL_TILES, COL_STAGES, PRECISION, PAGE, LIBDEVICE_EXP, GELU_TANH)
        elif COL_STAGES > 1 and BLOCK_R > 32 and rank <= 32:
            _silu_lora_columns(
                in_ptr, out_ptr, stride_in, stride_out, inter, tok, tok_ok, rank, page_row, f_ptr, stride_ft,
                stride_fr, rank_width, b_ptr, stride_bp, stride_br, stride_bn,
                BLOCK_M, BLOCK_N, 32, COL_TILES, COL_STAGES, PRECISION, PAGE, LIBDEVICE_EXP, GELU_TANH)
        else:
            _silu_lora_columns(
                in_ptr, out_ptr, stride_in, stride_out, inter, tok, tok_ok, rank, page_row, f_ptr, stride_ft,
                stride_fr, rank_width, b_ptr, stride_bp, stride_br, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_R, COL_TILES, COL_STAGES, PRECISION, PAGE, LIBDEVICE_EXP, GELU_TANH)
        tile += tl.num_programs(1)
        slot, m_tile = next_slot, next_m_tile


_silu_and_mul_lora_launch = CachedLauncher(_silu_and_mul_lora_kernel)


@dataclass(frozen=True)
class SiluLoRAConfig:
    """The shape of silu_and_mul with LoRA factors. Measured on an H200 at T = 8064-8251, I = 14336, 8-108
    adapters of rank 16 in a pool of rank width 16 (8 prompts of 1024 tokens; 28 of 288; 28 of 288 and 187
    decode rows of 80 more adapters): a tile's factors and pages loaded once for its 8 column tiles of 64 and
    their loads pipelined 3 deep, 1.42-1.76x the plain kernel's time, where loading them per column tile of 4,
    unpipelined, took 1.99-2.50x; wider or taller tiles were slower. The dot is as wide as the step's largest
    rank (LoRAFactors.dot_width): in a pool of rank width 64, the same steps took 236-299 us told that their
    adapters have rank 16, and 292-371 us told only the pool's width (a dot per tile of 16, 32 or 64 ranks, as
    its adapter's rank; 481-590 us with every dot 64 wide). Dots wider than lora_expand.MAX_PIPELINED_RANK
    take rank steps of 16 in each column tile, unpipelined."""

    block_m: int = 16  # tokens per tile (one of lora_meta.TILE_BLOCKS)
    block_n: int = 64  # output columns per tile
    col_tiles: int = 8  # column tiles each program walks for one token tile
    col_stages: int = 3  # the column tiles' loads in flight (lora_expand.pipelined_shape: widths up to 64)
    num_warps: int = 4
    tile_programs: bool = True  # one token program per tile a step can have (lora_shrink.token_programs)


def _silu_and_mul_factors(gate_up: torch.Tensor, factors: LoRAFactors, out: torch.Tensor,
                          config: SiluLoRAConfig | None = None, gelu_tanh: bool = False) -> None:
    """out = silu(gate) * up (or gelu_tanh(gate) * up) with gate/up's LoRA product expanded from its factors in
    the same launch."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    f, cfg = factors, config or SiluLoRAConfig()
    if tuple(f.slice_offsets) != (0, inter, two_inter) or f.inter.shape[0] != num_tokens:
        raise ValueError(f"LoRA factors of slices {tuple(f.slice_offsets)} and {f.inter.shape[0]} tokens do not "
                         f"match a gate/up output of {num_tokens} x {two_inter}")
    meta = f.meta
    tile_map = meta.tile_map(cfg.block_m)
    programs = token_programs(num_tokens, cfg.block_m, meta.num_loras, cfg.tile_programs)
    col_stages, block_r = pipelined_shape(cfg.col_stages, 16, f.dot_width)
    grid = (cdiv(cdiv(inter, cfg.block_n), cfg.col_tiles), programs + 1)
    _silu_and_mul_lora_launch(grid,
        gate_up, out, gate_up.stride(0), out.stride(0), num_tokens, inter,
        f.inter, f.inter.stride(0), f.inter.stride(1), f.rank_width,
        f.lora_b, f.lora_b.stride(0), f.lora_b.stride(1), f.lora_b.stride(2),
        f.lora_rank, meta.sorted_token_ids, meta.slot_start, meta.slot_count, meta.slot_adapter, tile_map,
        meta.page_table, meta.page_table.stride(0), tile_map.shape[0],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, COL_TILES=cfg.col_tiles, COL_STAGES=col_stages,
        PRECISION=dot_precision(f.lora_b.dtype), PAGE=PAGE_RANK,
        LIBDEVICE_EXP=gate_up.is_cuda, num_warps=cfg.num_warps, num_stages=1, enable_fp_fusion=False,
        GELU_TANH=gelu_tanh,
        **pdl_launch(gate_up))


@triton.jit
def _rotate_heads(
    src_ptr, stride_src_h, delta_ptr, stride_delta_h, dst_ptr, stride_dst_h,  # base pointers at this token
    heads, head_mask, d, d_mask, cos, sin, half,  # heads: [HB]; d: [BLOCK_HALF]; cos, sin: [BLOCK_HALF] fp32
    HAS_DELTA: tl.constexpr,
    norm_w_ptr, inv_head_dim, eps, QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """dst[h] = [x1*c - x2*s, x2*c + x1*s] for heads ``heads``; each product and sum rounds to src's dtype.
    With a delta, x = round(src + delta) first; with QK_NORM, then x = RMSNorm(x) over each head with the
    weight at norm_w_ptr ([2 * half]), as rms_norm rounds (UNIT_OFFSET: Gemma's)."""
    mask = head_mask[:, None] & d_mask[None, :]
    src = src_ptr + heads[:, None] * stride_src_h + d[None, :]  # [HB, BLOCK_HALF]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_DELTA:
        dsrc = delta_ptr + heads[:, None] * stride_delta_h + d[None, :]  # [HB, BLOCK_HALF]
        x1 = (x1.to(tl.float32) + tl.load(dsrc, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        x2 = (x2.to(tl.float32) + tl.load(dsrc + half, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    if QK_NORM:
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) * inv_head_dim + eps)[:, None]
        w1 = tl.load(norm_w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_HALF]
        w2 = tl.load(norm_w_ptr + half + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1 = _weighted(x1f, rstd, w1, dtype, UNIT_OFFSET).to(dtype)
        x2 = _weighted(x2f, rstd, w2, dtype, UNIT_OFFSET).to(dtype)
    c = cos.to(dtype).to(tl.float32)[None, :]
    s = sin.to(dtype).to(tl.float32)[None, :]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = dst_ptr + heads[:, None] * stride_dst_h + d[None, :]
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, o1.to(dtype).to(out_ty), mask=mask)
    tl.store(dst + half, o2.to(dtype).to(out_ty), mask=mask)


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, dq_ptr, dk_ptr, dv_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_qot, stride_qoh,
    num_heads, num_kv_heads, block_size, half,
    HAS_DELTA: tl.constexpr, HB: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
    q_norm_ptr, k_norm_ptr, inv_head_dim, norm_eps, QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """Program (token, group): groups < cdiv(H, HB) rotate q heads; the rest rotate k and copy v to the cache."""
    if PDL:  # launched early: wait for the kernel before it (it wrote q, k, v) before anything else
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    num_q_groups = tl.cdiv(num_heads, HB)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_mask, other=0.0)  # [BLOCK_HALF] fp32
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + d, mask=d_mask, other=0.0)
    if group < num_q_groups:
        heads = group * HB + tl.arange(0, HB)
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, dq_ptr + t * stride_dqt, stride_dqh,
                      q_out_ptr + t * stride_qot, stride_qoh, heads, heads < num_heads, d, d_mask, cos, sin, half,
                      HAS_DELTA, q_norm_ptr, inv_head_dim, norm_eps, QK_NORM, UNIT_OFFSET)
    else:
        heads = (group - num_q_groups) * HB + tl.arange(0, HB)
        head_mask = heads < num_kv_heads
        slot = tl.load(slot_ptr + t).to(tl.int64)
        blk = slot // block_size
        off = slot % block_size
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, dk_ptr + t * stride_dkt, stride_dkh,
                      k_cache_ptr + blk * stride_kcb + off * stride_kcs, stride_kch,
                      heads, head_mask, d, d_mask, cos, sin, half, HAS_DELTA,
                      k_norm_ptr, inv_head_dim, norm_eps, QK_NORM, UNIT_OFFSET)
        cols = tl.arange(0, 2 * BLOCK_HALF)
        mask = head_mask[:, None] & (cols < 2 * half)[None, :]
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)  # [HB, 2*BH]
        if HAS_DELTA:
            dv = tl.load(dv_ptr + t * stride_dvt + heads[:, None] * stride_dvh + cols[None, :], mask=mask)
            v = (v.to(tl.float32) + dv.to(tl.float32)).to(v.dtype)
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + cols[None, :]
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_rotary_and_cache_launch = CachedLauncher(_rotary_and_cache_kernel)


def rotary_and_cache(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, KVH, hd]
    v: torch.Tensor,  # [T, KVH, hd]
    positions: torch.Tensor,  # [T] int64
    cos_sin: torch.Tensor,  # [P, hd] fp32: cos in the first hd/2 columns, sin in the last hd/2
    k_cache: torch.Tensor,  # [NB, BS, KVH, hd]
    v_cache: torch.Tensor,  # [NB, BS, KVH, hd]
    slot_mapping: torch.Tensor,  # [T] int64, every entry a valid slot
    qkv_delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # shaped as q, k, v; float32 or q's dtype
    qk_norm: QKNorm | None = None,  # per-head RMSNorm of q and k after the delta, before rotary
) -> torch.Tensor:  # [T, H, hd] rotated q (new contiguous tensor, dtype of q)
    """Rotary on q and k, rotated k and plain v written to the caches, in one launch; see ``rotary_and_cache_ref``.

    Rounding matches torch bit for bit in bf16/fp16: cos/sin are rounded to
    the model dtype, each product ``x*cos``, ``x*sin`` is computed in fp32
    and rounded to the model dtype, then their sum is computed in fp32 and
    rounded (exactly what torch's elementwise bf16 ops do). FMA contraction
    is disabled (``enable_fp_fusion=False``), so fp32 is bit for bit too.
    q/k/v may be strided views (e.g. splits of the packed qkv output) with
    a contiguous last dim.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos_sin.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and cos_sin.dtype == torch.float32
    dq, dk, dv = (q, k, v) if qkv_delta is None else qkv_delta
    if qkv_delta is not None:
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert dq.stride(-1) == dk.stride(-1) == dv.stride(-1) == 1
        assert dq.dtype == dk.dtype == dv.dtype and dq.dtype in (torch.float32, q.dtype)
    if qk_norm is not None:
        assert qk_norm.q_weight.shape == qk_norm.k_weight.shape == (head_dim,)
        assert qk_norm.q_weight.is_contiguous() and qk_norm.k_weight.is_contiguous()
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    norm = qk_norm or QKNorm(cos_sin, cos_sin, 0.0, False)  # the pointers are unused without QK_NORM
    block_half = next_power_of_2(half)
    hb = max(1, min(_ROTARY_TILE // block_half, next_power_of_2(max(num_heads, num_kv_heads))))
    grid = (num_tokens, cdiv(num_heads, hb) + cdiv(num_kv_heads, hb))
    _rotary_and_cache_launch(grid,
        q, k, v, dq, dk, dv, positions, cos_sin, k_cache, v_cache, slot_mapping, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_out.stride(0), q_out.stride(1),
        num_heads, num_kv_heads, k_cache.shape[1], half,
        HAS_DELTA=qkv_delta is not None, HB=hb, BLOCK_HALF=block_half, num_warps=4, enable_fp_fusion=False,
        q_norm_ptr=norm.q_weight, k_norm_ptr=norm.k_weight, inv_head_dim=1.0 / head_dim, norm_eps=norm.eps,
        QK_NORM=qk_norm is not None, UNIT_OFFSET=norm.unit_offset, **pdl_launch(q),
    )
    return q_out
