"""Fused elementwise kernels (fp32, tiny shapes) against their torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET). The references are checked bit for
bit against HF's formulation written out here (RMSNorm, ``x*cos +
rotate_half(x)*sin``, attention_reference.write_kv_cache), in fp32 and bf16.
"""
import pytest
import torch
import torch.nn.functional as F

from loraserve.kernels.attention_reference import write_kv_cache
from loraserve.kernels.fused import gelu_tanh_and_mul, rms_norm, rotary_and_cache, silu_and_mul
from loraserve.kernels.fused_reference import (
    QKNorm,
    gelu_tanh_and_mul_ref,
    rms_norm_ref,
    rotary_and_cache_ref,
    silu_and_mul_ref,
)
from loraserve.kernels.lora_expand import LoRAFactors
from loraserve.kernels.lora_reference import lora_expand_ref
from loraserve.models.layers import RotaryEmbedding
from test_lora_kernels import make_case, poisoned_inter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def rand(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def make_weight(dim, dtype, gen):
    return (1.0 + 0.1 * torch.randn(dim, generator=gen)).to(device=DEVICE, dtype=dtype)


def hf_rms_norm(x, weight):
    """HF LlamaRMSNorm.forward."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * xf.to(x.dtype)


def hf_gemma_rms_norm(x, weight):
    """HF Gemma2RMSNorm / Gemma3RMSNorm.forward."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * (1.0 + weight.float())).type_as(x)


def hf_rotary(positions, cos_sin, q, k):
    """HF apply_rotary_pos_emb with the model-dtype cos/sin."""
    cos, sin = cos_sin[positions].to(q.dtype).chunk(2, dim=-1)  # [T, hd/2] each
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, hd]
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def make_rotary(head_dim, max_pos):
    rotary = RotaryEmbedding(head_dim, max_pos, 10000.0, None).to(DEVICE)
    rotary.reset_buffers()
    return rotary


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen):
    """q, k, v as strided views of one packed [T, (H + 2 KVH) * hd] tensor, as the model splits it."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = 3 * rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return k_cache, k_cache.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_ref_matches_layers(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    weight = make_weight(72, dtype, gen)
    x, residual = rand(5, 72, dtype=dtype, gen=gen), rand(5, 72, dtype=dtype, gen=gen)
    out, new_res = rms_norm_ref(x, weight, EPS, residual if with_residual else None)
    s = residual + x if with_residual else x  # the HF decoder's residual add
    assert torch.equal(out, hf_rms_norm(s, weight))
    assert new_res is None if not with_residual else torch.equal(new_res, s)


def test_silu_and_mul_ref_matches_torch():
    gen = torch.Generator().manual_seed(1)
    gate_up = rand(4, 2 * 40, dtype=torch.bfloat16, gen=gen)
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate) * up)
    want = (gate.float() * torch.sigmoid(gate.float())).to(torch.bfloat16).float() * up.float()
    assert torch.equal(silu_and_mul_ref(gate_up), want.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_and_cache_ref_matches_layers(dtype, head_dim):
    gen = torch.Generator().manual_seed(2)
    rotary = make_rotary(head_dim, 64)
    q, k, v = qkv_views(6, 4, 2, head_dim, dtype, gen)
    positions = torch.randint(0, 64, (6,), generator=gen).to(DEVICE)
    slots = torch.randperm(3 * 4, generator=gen)[:6].to(DEVICE)
    want_kc, want_vc = make_caches(3, 4, 2, head_dim, dtype)
    got_kc, got_vc = make_caches(3, 4, 2, head_dim, dtype)
    want_q, want_k = hf_rotary(positions, rotary.cos_sin, q, k)
    write_kv_cache(want_k, v, want_kc, want_vc, slots)
    got_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, got_kc, got_vc, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_kc.nan_to_num(), want_kc.nan_to_num())
    assert torch.equal(got_vc.nan_to_num(), want_vc.nan_to_num())


@pytest.mark.parametrize("dim", [72, 576, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dim, with_residual):
    gen = torch.Generator().manual_seed(dim)
    weight = make_weight(dim, torch.float32, gen)
    wide = rand(3, dim + 8, gen=gen)
    x = wide[:, :dim]  # strided rows
    residual = rand(3, dim, gen=gen) if with_residual else None
    out, new_res = rms_norm(x, weight, EPS, residual)
    want, want_res = rms_norm_ref(x, weight, EPS, residual)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)
    if with_residual:
        assert torch.equal(new_res, want_res)
    else:
        assert new_res is None


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the interpreter does not round to bf16 as the GPU does"))])
@pytest.mark.parametrize(("with_delta", "unit_offset", "with_pre"), [(False, False, False), (True, False, False),
                                                                  (True, True, True)])
def test_rms_norm_rounds_an_fp32_sum_to_the_residual_dtype_first(dtype, with_delta, unit_offset, with_pre):
    """x in float32 with a half-precision residual (a row-parallel layer's unrounded sum): the kernel and the
    reference each give what they give for x rounded to that dtype first, bit for bit, in that dtype."""
    gen = torch.Generator().manual_seed(11)
    dim = 72
    x = 3 * rand(5, dim, gen=gen)  # float32, most values not bf16-representable
    residual = rand(5, dim, dtype=dtype, gen=gen)
    delta = 0.3 * rand(5, dim, gen=gen) if with_delta else None
    weight = make_weight(dim, dtype, gen)
    pre = make_weight(dim, dtype, gen) if with_pre else None
    assert not torch.equal(x.to(dtype).float(), x)
    for norm in (rms_norm_ref, rms_norm):
        want, want_res = norm(x.to(dtype), weight, EPS, residual, delta, pre, unit_offset)
        got, got_res = norm(x, weight, EPS, residual, delta, pre, unit_offset)
        assert got.dtype == want.dtype == dtype and got_res.dtype == dtype
        assert torch.equal(got, want) and torch.equal(got_res, want_res)


def test_rms_norm_kernel_empty():
    out, new_res = rms_norm(torch.empty(0, 8, device=DEVICE), torch.ones(8, device=DEVICE), EPS)
    assert out.shape == (0, 8) and new_res is None


@pytest.mark.parametrize("inter", [40, 1100])
def test_silu_and_mul_kernel(inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = 4 * rand(3, 2 * inter + 16, gen=gen)[:, : 2 * inter]  # strided rows
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 64), (2, 2, 16)])
def test_rotary_and_cache_kernel(num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    num_tokens, num_blocks, block_size = 5, 4, 4
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, torch.float32, gen)
    rotary = make_rotary(head_dim, 128)
    positions = torch.randint(0, 128, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    want_kc, want_vc = make_caches(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    got_kc, got_vc = make_caches(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    want_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, want_kc, want_vc, slots)
    got_q = rotary_and_cache(q, k, v, positions, rotary.cos_sin, got_kc, got_vc, slots)
    assert torch.equal(got_q, want_q)
    for got, want in ((got_kc, want_kc), (got_vc, want_vc)):  # slots no token maps to stay NaN
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_refs_add_lora_delta_first():
    """A float32 delta is the projection's LoRA product: round(input + delta), then the op as before."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    x, residual = rand(4, 72, dtype=dtype, gen=gen), rand(4, 72, dtype=dtype, gen=gen)
    delta = 0.3 * rand(4, 72, gen=gen)
    merged = (x.float() + delta).to(dtype)
    weight = make_weight(72, dtype, gen)
    got, got_res = rms_norm_ref(x, weight, EPS, residual, delta)
    want, want_res = rms_norm_ref(merged, weight, EPS, residual)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert not torch.equal(got, rms_norm_ref(x, weight, EPS, residual)[0])
    gate_up, gu_delta = rand(4, 80, dtype=dtype, gen=gen), rand(4, 80, gen=gen)
    assert torch.equal(silu_and_mul_ref(gate_up, gu_delta),
                       silu_and_mul_ref((gate_up.float() + gu_delta).to(dtype)))
    rotary = make_rotary(16, 64)
    q, k, v = qkv_views(4, 4, 2, 16, dtype, gen)
    deltas = tuple(rand(*t.shape, gen=gen) for t in (q, k, v))
    positions = torch.randint(0, 64, (4,), generator=gen).to(DEVICE)
    slots = torch.randperm(12, generator=gen)[:4].to(DEVICE)
    got_c, want_c = make_caches(3, 4, 2, 16, dtype), make_caches(3, 4, 2, 16, dtype)
    got_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, *got_c, slots, deltas)
    merged_qkv = [(t.float() + d).to(dtype) for t, d in zip((q, k, v), deltas)]
    want_q = rotary_and_cache_ref(*merged_qkv, positions, rotary.cos_sin, *want_c, slots)
    assert torch.equal(got_q, want_q)
    for got, want in zip(got_c, want_c):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_kernels_with_lora_delta():
    """The kernels' delta inputs (strided float32 views, as the model passes them) match the references."""
    gen = torch.Generator().manual_seed(6)
    x, residual, weight = rand(3, 72, gen=gen), rand(3, 72, gen=gen), make_weight(72, torch.float32, gen)
    delta = rand(3, 80, gen=gen)[:, :72]
    out, new_res = rms_norm(x, weight, EPS, residual, delta)
    want, want_res = rms_norm_ref(x, weight, EPS, residual, delta)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(new_res, want_res)
    gate_up, gu_delta = rand(3, 80, gen=gen), rand(3, 96, gen=gen)[:, :80]
    torch.testing.assert_close(silu_and_mul(gate_up, gu_delta), silu_and_mul_ref(gate_up, gu_delta),
                               rtol=2e-6, atol=1e-6)
    rotary = make_rotary(16, 128)
    q, k, v = qkv_views(5, 4, 2, 16, torch.float32, gen)
    dq, dk, dv = qkv_views(5, 4, 2, 16, torch.float32, gen)
    positions = torch.randint(0, 128, (5,), generator=gen).to(DEVICE)
    slots = torch.randperm(16, generator=gen)[:5].to(DEVICE)
    want_c, got_c = make_caches(4, 4, 2, 16, torch.float32), make_caches(4, 4, 2, 16, torch.float32)
    want_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, *want_c, slots, (dq, dk, dv))
    got_q = rotary_and_cache(q, k, v, positions, rotary.cos_sin, *got_c, slots, (dq, dk, dv))
    assert torch.equal(got_q, want_q)
    for got, want in zip(got_c, want_c):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norms_ref_match_hf(dtype):
    """unit_offset is HF Gemma's norm; pre_weight is Gemma's post-attention norm, the residual add and the
    pre-feedforward norm of its decoder layer, written out."""
    gen = torch.Generator().manual_seed(10)
    w_post, w_pre = 0.1 * rand(72, dtype=dtype, gen=gen), 0.1 * rand(72, dtype=dtype, gen=gen)
    attn_out, residual = rand(5, 72, dtype=dtype, gen=gen), rand(5, 72, dtype=dtype, gen=gen)
    out, _ = rms_norm_ref(attn_out, w_pre, EPS, unit_offset=True)
    assert torch.equal(out, hf_gemma_rms_norm(attn_out, w_pre))
    out, new_res = rms_norm_ref(attn_out, w_pre, EPS, residual, pre_weight=w_post, unit_offset=True)
    stream = residual + hf_gemma_rms_norm(attn_out, w_post)
    assert torch.equal(new_res, stream) and torch.equal(out, hf_gemma_rms_norm(stream, w_pre))
    llama_pre, _ = rms_norm_ref(attn_out, w_pre, EPS, residual, pre_weight=w_post + 1)  # the Llama kind, too
    assert torch.equal(llama_pre, hf_rms_norm(residual + hf_rms_norm(attn_out, w_post + 1), w_pre))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual,with_pre,with_delta", [(False, False, False), (True, True, True),
                                                               (False, True, False), (True, False, True)])
def test_rms_norm_kernel_gemma_and_pre_norm(unit_offset, with_residual, with_pre, with_delta):
    gen = torch.Generator().manual_seed(11)
    dim = 96
    weight, pre = make_weight(dim, torch.float32, gen) - 1, make_weight(dim, torch.float32, gen) - 1
    x = rand(3, dim + 8, gen=gen)[:, :dim]
    residual = rand(3, dim, gen=gen) if with_residual else None
    delta = rand(3, dim, gen=gen) if with_delta else None
    pre_weight = pre if with_pre else None
    out, new_res = rms_norm(x, weight, EPS, residual, delta, pre_weight, unit_offset)
    want, want_res = rms_norm_ref(x, weight, EPS, residual, delta, pre_weight, unit_offset)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)
    if with_residual:
        torch.testing.assert_close(new_res, want_res, rtol=2e-6, atol=1e-6)
    else:
        assert new_res is None


def test_gelu_tanh_and_mul_ref_matches_hf_activation():
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(12)
    gate_up = 3 * rand(4, 2 * 40, dtype=torch.bfloat16, gen=gen)
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    assert torch.equal(gelu_tanh_and_mul_ref(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("inter", [40, 1100])
def test_gelu_tanh_and_mul_kernel(inter):
    gen = torch.Generator().manual_seed(inter + 1)
    gate_up = 4 * rand(3, 2 * inter + 16, gen=gen)[:, : 2 * inter]  # strided rows
    delta = rand(3, 2 * inter, gen=gen)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_ref(gate_up), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up, delta), gelu_tanh_and_mul_ref(gate_up, delta),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gelu_tanh_and_mul(gate_up), silu_and_mul(gate_up), atol=1e-2)


@pytest.mark.parametrize("inter_size,num_tokens,kind", [(40, 70, "skewed"), (130, 33, "distinct")])
def test_gelu_tanh_and_mul_expands_lora_factors(inter_size, num_tokens, kind):
    """As silu_and_mul's factors (tests/kernels/test_lora_kernels.py): the product expanded into gate/up and
    rounded, then the reference activation."""
    case = make_case(13, 16, (inter_size, inter_size), 16, 3, num_tokens, kind, 0.2)
    inter = poisoned_inter(case, case["meta"].rank_width)
    gate_up = torch.randn(num_tokens, 2 * inter_size + 6, generator=case["gen"]).to(DEVICE)[:, 3:-3]
    merged = gate_up.clone()
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], merged)
    factors = LoRAFactors(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"])
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up, factors), gelu_tanh_and_mul_ref(merged),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_ref(merged), atol=1e-3)


def hf_head_norms(q, k, qk_norm):
    """HF's q_norm / k_norm (Qwen3: Llama's norm; Gemma 3: Gemma's) on [T, heads, hd]."""
    norm = hf_gemma_rms_norm if qk_norm.unit_offset else hf_rms_norm
    return norm(q, qk_norm.q_weight), norm(k, qk_norm.k_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rotary_with_qk_norm_ref_matches_hf(dtype, unit_offset):
    gen = torch.Generator().manual_seed(14)
    rotary = make_rotary(16, 64)
    q, k, v = qkv_views(6, 4, 2, 16, dtype, gen)
    qk_norm = QKNorm(make_weight(16, dtype, gen), make_weight(16, dtype, gen), EPS, unit_offset)
    positions = torch.randint(0, 64, (6,), generator=gen).to(DEVICE)
    slots = torch.randperm(12, generator=gen)[:6].to(DEVICE)
    want_c, got_c = make_caches(3, 4, 2, 16, dtype), make_caches(3, 4, 2, 16, dtype)
    want_q, want_k = hf_rotary(positions, rotary.cos_sin, *hf_head_norms(q, k, qk_norm))
    write_kv_cache(want_k, v, *want_c, slots)
    got_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, *got_c, slots, qk_norm=qk_norm)
    assert torch.equal(got_q, want_q)
    for got, want in zip(got_c, want_c):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "with_delta"),
                         [(4, 2, 16, False), (3, 1, 48, True), (2, 2, 64, True)])
def test_rotary_and_cache_kernel_with_qk_norm(unit_offset, num_heads, num_kv_heads, head_dim, with_delta):
    """head_dim 48: a half (24) that is not a power of two, the norm's sum over a masked tile."""
    gen = torch.Generator().manual_seed(15 + head_dim)
    q, k, v = qkv_views(5, num_heads, num_kv_heads, head_dim, torch.float32, gen)
    deltas = qkv_views(5, num_heads, num_kv_heads, head_dim, torch.float32, gen) if with_delta else None
    qk_norm = QKNorm(make_weight(head_dim, torch.float32, gen) - 0.5, make_weight(head_dim, torch.float32, gen),
                     EPS, unit_offset)
    rotary = make_rotary(head_dim, 128)
    positions = torch.randint(0, 128, (5,), generator=gen).to(DEVICE)
    slots = torch.randperm(16, generator=gen)[:5].to(DEVICE)
    want_c = make_caches(4, 4, num_kv_heads, head_dim, torch.float32)
    got_c = make_caches(4, 4, num_kv_heads, head_dim, torch.float32)
    want_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, *want_c, slots, deltas, qk_norm)
    got_q = rotary_and_cache(q, k, v, positions, rotary.cos_sin, *got_c, slots, deltas, qk_norm)
    torch.testing.assert_close(got_q, want_q, rtol=2e-6, atol=1e-6)
    for got, want in zip(got_c, want_c):
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=2e-6, atol=1e-6)
    plain = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, *make_caches(4, 4, num_kv_heads, head_dim,
                                                                                   torch.float32), slots, deltas)
    assert not torch.allclose(plain, want_q, atol=1e-3)
