"""GPU tests of the fused elementwise kernels against their torch references, Llama-3-8B shapes.

Rotary + cache writes and SiLU*mul are bit for bit in every dtype, as is the
new residual. RMSNorm's fp32 sum of squares runs in another order than
torch's, so its output may be two ulps off (one ulp in the normalized value,
then the weight multiply rounds), in a small fraction of elements. A CUDA-graph test captures all three kernels and
replays them on fresh inputs.
"""
import pytest
import torch

from loraserve.kernels.fused import rms_norm, rotary_and_cache, silu_and_mul
from loraserve.kernels.fused_reference import rms_norm_ref, rotary_and_cache_ref, silu_and_mul_ref
from loraserve.models.layers import RotaryEmbedding

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 3, 257, 4096]
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
BLOCK_SIZE, MAX_POS, EPS = 16, 8192, 1e-5


def rand(*shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def assert_ulps(got, want, ulps, max_mismatch=1e-3):
    """|got - want| <= ulps * eps(dtype) * max(|got|, |want|), and at most max_mismatch of elements differ."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    tol = ulps * torch.finfo(got.dtype).eps * torch.maximum(g.abs(), w.abs()) + 1e-30
    bad = (g - w).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than {ulps} ulp; max diff {(g - w).abs().max()}"
    mismatch = (g != w).float().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2e} of elements differ"


def assert_within(got, want, scale, ulps):
    """|got - want| <= ulps * eps(dtype) * scale elementwise, where scale >= |want| is the size of the terms the
    value is computed from: where those terms cancel, a last-bit difference in one of them is many ulps of the
    result (rotations, 1 + tanh near -1, a residual add), so the result's own ulps are no bound there."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    tol = ulps * torch.finfo(got.dtype).eps * scale.double()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} elements differ by more than {ulps} ulp of their terms; "
                           f"worst {float((err / tol.clamp_min(1e-300)).max()):.2f}x the bound")


def assert_norm_close(got, want):
    """fp32: a different rstd moves most elements by an ulp or a few; bf16/fp16: a few, by at most two ulps.

    With one row (T=1, fp16) 0.22 % of elements were seen to differ.
    """
    if got.dtype == torch.float32:
        assert_ulps(got, want, 16, max_mismatch=1.0)
    else:
        assert_ulps(got, want, 2, max_mismatch=1e-2)


def rotary_table():
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}).cuda()
    rotary.reset_buffers()
    return rotary.cos_sin  # [P, hd] fp32


def rotary_inputs(num_tokens, dtype, gen):
    """Strided q/k/v views of one packed qkv tensor, positions, distinct slots, NaN caches."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen, scale=3.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device="cuda")
    num_blocks = num_tokens // BLOCK_SIZE + 3
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device="cuda")[:num_tokens]
    caches = torch.full((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype, device="cuda")
    return q, k, v, positions, slots, caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dim", [HIDDEN, 576])
def test_rms_norm(dtype, num_tokens, with_residual, dim):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    weight = (1.0 + 0.1 * torch.randn(dim, generator=gen, device="cuda")).to(dtype)
    x = rand(num_tokens, dim, dtype=dtype, gen=gen, scale=2.0)
    residual = rand(num_tokens, dim, dtype=dtype, gen=gen, scale=4.0) if with_residual else None
    out, new_res = rms_norm(x, weight, EPS, residual)
    want, want_res = rms_norm_ref(x, weight, EPS, residual)
    assert_norm_close(out, want)
    if with_residual:
        assert torch.equal(new_res, want_res)
    else:
        assert new_res is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_silu_and_mul(dtype, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    gate_up = rand(num_tokens, 2 * INTER, dtype=dtype, gen=gen, scale=3.0)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("delta_in_model_dtype", [False, True])
def test_lora_delta_inputs(dtype, num_tokens, delta_in_model_dtype):
    """With LoRA deltas (float32, or the model dtype as the engine's) the kernels match the references
    (bit for bit but the norm's last ulp)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    delta_dtype = dtype if delta_in_model_dtype else torch.float32
    weight = (1.0 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).to(dtype)
    x, residual = rand(num_tokens, HIDDEN, dtype=dtype, gen=gen), rand(num_tokens, HIDDEN, dtype=dtype, gen=gen)
    delta = rand(num_tokens, HIDDEN, dtype=delta_dtype, gen=gen, scale=0.5)
    out, new_res = rms_norm(x, weight, EPS, residual, delta)
    want, want_res = rms_norm_ref(x, weight, EPS, residual, delta)
    assert_norm_close(out, want)
    assert torch.equal(new_res, want_res)
    gate_up = rand(num_tokens, 2 * INTER, dtype=dtype, gen=gen, scale=3.0)
    gu_delta = rand(num_tokens, 2 * INTER, dtype=delta_dtype, gen=gen)
    assert torch.equal(silu_and_mul(gate_up, gu_delta), silu_and_mul_ref(gate_up, gu_delta))
    cos_sin = rotary_table()
    q, k, v, positions, slots, caches = rotary_inputs(num_tokens, dtype, gen)
    deltas = tuple(rand(*t.shape, dtype=delta_dtype, gen=gen) for t in (q, k, v))
    got_caches, want_caches = caches.clone(), caches.clone()
    got_q = rotary_and_cache(q, k, v, positions, cos_sin, got_caches[0], got_caches[1], slots, deltas)
    want_q = rotary_and_cache_ref(q, k, v, positions, cos_sin, want_caches[0], want_caches[1], slots, deltas)
    assert torch.equal(got_caches.nan_to_num(), want_caches.nan_to_num())
    assert torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_and_cache(dtype, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    cos_sin = rotary_table()
    q, k, v, positions, slots, caches = rotary_inputs(num_tokens, dtype, gen)
    got_caches, want_caches = caches.clone(), caches.clone()
    got_q = rotary_and_cache(q, k, v, positions, cos_sin, got_caches[0], got_caches[1], slots)
    want_q = rotary_and_cache_ref(q, k, v, positions, cos_sin, want_caches[0], want_caches[1], slots)
    assert torch.equal(got_caches.isnan(), want_caches.isnan())
    assert torch.equal(got_caches.nan_to_num(), want_caches.nan_to_num())
    assert torch.equal(got_q, want_q)


def test_cuda_graph_replay():
    """Capture norm + rotary/cache + silu*mul once; replays on new inputs match the references."""
    dtype, num_tokens = torch.bfloat16, 8
    gen = torch.Generator(device="cuda").manual_seed(7)
    cos_sin = rotary_table()
    q, k, v, positions, slots, caches = rotary_inputs(num_tokens, dtype, gen)
    x, residual = rand(num_tokens, HIDDEN, dtype=dtype, gen=gen), rand(num_tokens, HIDDEN, dtype=dtype, gen=gen)
    weight = rand(HIDDEN, dtype=dtype, gen=gen)
    gate_up = rand(num_tokens, 2 * INTER, dtype=dtype, gen=gen)

    def step():
        normed, new_res = rms_norm(x, weight, EPS, residual)
        q_rot = rotary_and_cache(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
        return normed, new_res, q_rot, silu_and_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        g2 = torch.Generator(device="cuda").manual_seed(100 + seed)
        for t in (x, residual, gate_up, q, k, v):  # q/k/v are views: refill their storage
            t.copy_(torch.randn(t.shape, generator=g2, device="cuda"))
        positions.copy_(torch.randint(0, MAX_POS, (num_tokens,), generator=g2, device="cuda"))
        slots.copy_(torch.randperm(caches.shape[1] * BLOCK_SIZE, generator=g2, device="cuda")[:num_tokens])
        caches.fill_(float("nan"))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        want_caches = torch.full_like(caches, float("nan"))
        want_q = rotary_and_cache_ref(q, k, v, positions, cos_sin, want_caches[0], want_caches[1], slots)
        want_norm, want_res = rms_norm_ref(x, weight, EPS, residual)
        assert_norm_close(outs[0], want_norm)
        assert torch.equal(outs[1], want_res)
        assert torch.equal(outs[2], want_q)
        assert torch.equal(caches.nan_to_num(), want_caches.nan_to_num())
        assert torch.equal(outs[3], silu_and_mul_ref(gate_up))


def test_cached_launches_follow_pointer_alignment():
    """The launcher re-dispatches when an input stops being 16-byte aligned (Triton's vector loads
    assume it): aligned, then misaligned, then aligned inputs all match the reference."""
    dtype, num_tokens = torch.bfloat16, 5
    gen = torch.Generator(device="cuda").manual_seed(11)
    weight = rand(HIDDEN, dtype=dtype, gen=gen)
    storage = rand(num_tokens * HIDDEN + 1, dtype=dtype, gen=gen)
    aligned = storage[:-1].view(num_tokens, HIDDEN)
    shifted = storage[1:].view(num_tokens, HIDDEN)  # 2 bytes past the allocation's alignment
    assert shifted.data_ptr() % 16 != 0
    for x in (aligned, shifted, aligned, shifted):
        got = rms_norm(x, weight, EPS)[0]
        assert_norm_close(got, rms_norm_ref(x, weight, EPS)[0])
        assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
