"""GPU tests of the kernels the architectures beyond Llama use, at their real shapes (marked gpu): Gemma's norms,
GeLU-tanh * up (also expanding LoRA factors), rotary with per-head q/k norms (Qwen3-8B, Gemma-3-12B), and paged
attention with sliding windows, soft-capping and head dims 96 and 256, against the torch references; a CUDA
graph of Gemma's norm, GeLU-tanh and windowed decode attention replayed on fresh inputs."""
import pytest
import torch

from loraserve.kernels.attention import paged_decode_attention, paged_prefill_attention
from loraserve.kernels.attention_reference import paged_attention_ref
from loraserve.kernels.fused import gelu_tanh_and_mul, rms_norm, rotary_and_cache
from loraserve.kernels.fused_reference import QKNorm, gelu_tanh_and_mul_ref, rms_norm_ref, rotary_and_cache_ref
from loraserve.kernels.lora_expand import LoRAFactors
from loraserve.kernels.lora_reference import lora_expand_ref
from loraserve.models.layers import RotaryEmbedding
from test_attention_kernels_gpu import TOL, decode_reference, random_lens, setup
from test_fused_kernels_gpu import assert_norm_close, assert_ulps, assert_within, rand
from test_lora_kernels import make_case, poisoned_inter

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 257])
@pytest.mark.parametrize("with_pre", [False, True])
def test_gemma_rms_norm(dtype, num_tokens, with_pre):
    """Gemma-3-12B's hidden size; with_pre: post-attention norm, residual add and pre-feedforward norm at once."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    dim = 3840
    weight, pre = rand(dim, dtype=dtype, gen=gen, scale=0.3), rand(dim, dtype=dtype, gen=gen, scale=0.3)
    x, residual = rand(num_tokens, dim, dtype=dtype, gen=gen, scale=2.0), rand(num_tokens, dim, dtype=dtype, gen=gen)
    pre_weight = pre if with_pre else None
    out, new_res = rms_norm(x, weight, EPS, residual, None, pre_weight, unit_offset=True)
    want, want_res = rms_norm_ref(x, weight, EPS, residual, None, pre_weight, unit_offset=True)
    if not with_pre:
        assert_norm_close(out, want)
        assert torch.equal(new_res, want_res)
    elif dtype != torch.float32:  # the first norm's rstd may differ in its last bit too
        assert_norm_close(out, want)
        assert_norm_close(new_res, want_res)
    else:  # fp32: the first norm's last bits, then the residual add (which may cancel), then the second norm
        s = want_res.double()
        terms = (s - residual.double()).abs() + residual.double().abs()  # |normed x| + |residual|
        rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
        assert_within(new_res, want_res, terms, 16)
        assert_within(out, want, terms * rstd * (1.0 + weight.double()).abs() + want.double().abs(), 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_gelu_tanh_and_mul(dtype, num_tokens):
    """Gemma-3-12B's intermediate size; CUDA's tanhf as torch's, the products may round differently where torch
    contracts to FMA: bf16, within one ulp; fp32, within a few ulps of gate * up (1 + tanh cancels for a
    negative gate, so its own ulps are no bound)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    gate_up = rand(num_tokens, 2 * 15360, dtype=dtype, gen=gen, scale=3.0)
    delta = rand(num_tokens, 2 * 15360, dtype=torch.float32, gen=gen, scale=0.3)
    for d in (None, delta):
        got, want = gelu_tanh_and_mul(gate_up, d), gelu_tanh_and_mul_ref(gate_up, d)
        if dtype == torch.float32:
            merged = gate_up.double() if d is None else (gate_up + d).double()
            gate, up = merged.chunk(2, dim=-1)
            assert_within(got, want, (gate * up).abs() + want.double().abs(), 4)
        else:
            assert_ulps(got, want, 1, max_mismatch=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_expands_lora_factors(dtype):
    case = make_case(21, 64, (640, 640), 16, 4, 300, "skewed", 0.2, dtype=dtype, device="cuda")
    inter = poisoned_inter(case, case["meta"].rank_width)
    gate_up = torch.randn(300, 2 * 640, generator=case["gen"]).to("cuda", dtype)
    merged = gate_up.clone()
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], merged)
    got = gelu_tanh_and_mul(gate_up, LoRAFactors(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"]))
    want = gelu_tanh_and_mul_ref(merged)
    if dtype == torch.float32:  # the expand sums in another order: within a few ulps of its terms' sizes
        terms = gate_up.double().abs()
        lora_expand_ref(inter.abs(), case["b"].abs(), case["slot_rank"], case["meta"], case["offsets"], terms)
        gate, up = terms.chunk(2, dim=-1)
        assert_within(got, want, gate * up + want.double().abs(), 8)
    else:
        tol = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 8, 128, False), (16, 8, 256, True)])  # Qwen3-8B, Gemma-3-12B
@pytest.mark.parametrize("num_tokens", [1, 257])
def test_rotary_with_qk_norm(dtype, shape, num_tokens):
    heads, kv_heads, head_dim, unit_offset = shape
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, None).cuda()
    rotary.reset_buffers()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen, scale=3.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    norm = QKNorm(rand(head_dim, dtype=dtype, gen=gen, scale=0.3) + (0 if unit_offset else 1),
                  rand(head_dim, dtype=dtype, gen=gen, scale=0.3) + (0 if unit_offset else 1), EPS, unit_offset)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device="cuda")
    slots = torch.randperm(num_tokens + 16, generator=gen, device="cuda")[:num_tokens]
    caches = torch.full((2, num_tokens // 16 + 2, 16, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    got_c, want_c = caches.clone(), caches.clone()
    got_q = rotary_and_cache(q, k, v, positions, rotary.cos_sin, got_c[0], got_c[1], slots, None, norm)
    want_q = rotary_and_cache_ref(q, k, v, positions, rotary.cos_sin, want_c[0], want_c[1], slots, None, norm)
    # the per-head sum of squares runs in another order: the normalized values (then rotated) may move by an ulp
    assert torch.equal(got_c.isnan(), want_c.isnan())
    got_c, want_c = got_c.nan_to_num(), want_c.nan_to_num()
    if dtype == torch.float32:  # x cos - y sin may cancel: within a few ulps of the rotated pair's length
        for got, want in ((got_q, want_q), (got_c, want_c)):
            w = want.double()
            pair = torch.hypot(w[..., :head_dim // 2], w[..., head_dim // 2:])
            assert_within(got, want, torch.cat([pair, pair], dim=-1), 8)
    else:
        assert_ulps(got_q, want_q, 3, max_mismatch=3e-2)
        assert_ulps(got_c, want_c, 3, max_mismatch=3e-2)


# (heads, kv heads, head_dim, window, softcap, scale): Gemma-3-12B sliding layers, Gemma-2-9B (soft-capped),
# Phi-3-mini (head_dim 96, window 2047), Mistral-7B's window
ATTENTION_CASES = [(16, 8, 256, 1024, None, 256 ** -0.5), (16, 8, 256, 4096, 50.0, 256 ** -0.5),
                   (32, 32, 96, 2047, None, 96 ** -0.5), (32, 8, 128, 4096, None, 128 ** -0.5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("batch,max_ctx", [(1, 5000), (24, 1500)])
def test_decode_with_window_and_softcap(dtype, case, batch, max_ctx):
    heads, kv_heads, head_dim, window, softcap, scale = case
    lens = random_lens(batch, max_ctx, torch.Generator().manual_seed(batch))
    gen, k_cache, v_cache, tables = setup(lens, heads, kv_heads, head_dim, dtype, -(-max_ctx // 16), seed=head_dim)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out, window=window, softcap=softcap)
    want = decode_reference(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_prefill_with_window_and_softcap(dtype, case):
    heads, kv_heads, head_dim, window, softcap, scale = case
    seq_cases = [(5000, 5000), (3000, 512), (17, 1), (2100, 37), (1100, 1100)]
    lens, q_lens = [n for n, _ in seq_cases], [m for _, m in seq_cases]
    gen, k_cache, v_cache, tables = setup(lens, heads, kv_heads, head_dim, dtype, 5000 // 16 + 3, seed=head_dim)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, max(q_lens), scale, out, window=window,
                            softcap=softcap)
    want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_cuda_graph_replay_of_the_new_kernels():
    """Gemma's fused norm, GeLU-tanh and windowed soft-capped decode attention, captured once; replays with new
    inputs and lengths match the references (rotary with q/k norms is not in this graph)."""
    dtype, n, heads, kv_heads, head_dim, window = torch.bfloat16, 8, 16, 8, 256, 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, residual = rand(n, 3840, dtype=dtype, gen=gen), rand(n, 3840, dtype=dtype, gen=gen)
    w, pre = rand(3840, dtype=dtype, gen=gen, scale=0.3), rand(3840, dtype=dtype, gen=gen, scale=0.3)
    gate_up = rand(n, 2 * 1024, dtype=dtype, gen=gen)
    lens = [200] * n
    _, k_cache, v_cache, tables = setup(lens, heads, kv_heads, head_dim, dtype, 16, seed=5)
    q = rand(n, heads, head_dim, dtype=dtype, gen=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    attn_out = torch.empty_like(q)

    def step():
        normed, new_res = rms_norm(x, w, EPS, residual, None, pre, unit_offset=True)
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.0625, attn_out, window=window, softcap=50.0)
        return normed, new_res, gelu_tanh_and_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        g2 = torch.Generator(device="cuda").manual_seed(100 + seed)
        for t in (x, residual, gate_up, q):
            t.copy_(torch.randn(t.shape, generator=g2, device="cuda"))
        seq_lens.copy_(torch.randint(1, 201, (n,), generator=g2, device="cuda", dtype=torch.int32))
        graph.replay()
        want_norm, want_res = rms_norm_ref(x, w, EPS, residual, None, pre, unit_offset=True)
        assert_norm_close(outs[0], want_norm)
        assert_norm_close(outs[1], want_res)
        assert_ulps(outs[2], gelu_tanh_and_mul_ref(gate_up), 1, max_mismatch=1e-2)
        want = decode_reference(q, k_cache, v_cache, tables, seq_lens, 0.0625, window, 50.0)
        torch.testing.assert_close(attn_out, want, atol=TOL[dtype], rtol=TOL[dtype])
