"""GPU tests of the Triton paged attention kernels against the torch reference.

The reference is itself checked against a naive dense loop on the CPU
(test_attention_kernels.py). Caches hold NaN in every slot no live token
occupies, so a kernel that reads past a sequence's end produces NaN.
"""
import pytest
import torch

from loraserve.kernels.attention import paged_decode_attention, paged_prefill_attention, paged_step_attention
from loraserve.kernels.attention_reference import paged_attention_ref

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def random_tables(seq_lens, max_blocks, num_blocks, gen):
    """Distinct random cache blocks for every sequence; the other table entries point at block 0."""
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(num_blocks - 1, generator=gen)[: sum(need)] + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[start : start + n]
        start += n
    return tables.cuda()


def fill_cache(cache, tables, seq_lens, gen):
    """Random values in the live slots of every sequence, NaN everywhere else."""
    num_blocks, block_size, kvh, d = cache.shape
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=cache.device)
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n, device=cache.device)
        live[tables[s, pos // block_size].long() * block_size + pos % block_size] = True
    flat = cache.view(-1, kvh, d)
    flat.fill_(float("nan"))
    values = torch.randn(flat.shape, generator=gen).to(device=cache.device, dtype=cache.dtype)
    flat[live] = values[live]


def setup(seq_lens, num_heads, num_kv_heads, head_dim, dtype, max_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 2
    tables = random_tables(seq_lens, max_blocks, num_blocks, gen)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device="cuda")
    v_cache = torch.empty(shape, dtype=dtype, device="cuda")
    fill_cache(k_cache, tables, seq_lens, gen)
    fill_cache(v_cache, tables, seq_lens, gen)
    return gen, k_cache, v_cache, tables


def decode_reference(q, k_cache, v_cache, tables, seq_lens, scale, window=None, softcap=None):
    """Reference per live row; padding rows (seq_len 0) expect zeros."""
    lens = seq_lens.tolist()
    want = torch.zeros_like(q)
    rows = [i for i, n in enumerate(lens) if n]
    if rows:
        idx = torch.tensor(rows, device=q.device)
        qsl = torch.arange(len(rows) + 1, dtype=torch.int32, device=q.device)
        want[idx] = paged_attention_ref(q[idx], k_cache, v_cache, tables[idx], seq_lens[idx],
                                        qsl, scale, window, softcap)
    return want


def random_lens(batch, max_ctx, gen):
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    lens[0] = max_ctx  # always one full-width context
    if batch > 2:
        lens[-1] = 0  # and one padding row
    return lens.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 4)])
@pytest.mark.parametrize("batch,max_ctx", [(1, 4096), (3, 1000), (64, 700), (256, 200)])
def test_decode_matches_reference(dtype, head_dim, num_heads, num_kv_heads, batch, max_ctx):
    if dtype == torch.float32 and batch > 3:
        pytest.skip("fp32 covered by the small batches")
    lens = random_lens(batch, max_ctx, torch.Generator().manual_seed(batch))
    max_blocks = -(-max_ctx // BLOCK_SIZE)
    gen, k_cache, v_cache, tables = setup(lens, num_heads, num_kv_heads, head_dim, dtype,
                                          max_blocks, seed=max_ctx)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out)
    want = decode_reference(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("batch", [1, 32])
def test_decode_cuda_graph_replays_with_new_tables_and_lengths(batch):
    num_heads, num_kv_heads, head_dim, dtype, max_ctx = 32, 8, 128, torch.bfloat16, 1024
    max_blocks = max_ctx // BLOCK_SIZE
    gen = torch.Generator().manual_seed(7)
    num_blocks = batch * max_blocks + 2
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device="cuda")
    v_cache = torch.empty(shape, dtype=dtype, device="cuda")
    # static graph inputs/outputs
    q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out)
    for _ in range(3):
        lens = random_lens(batch, max_ctx, gen)
        new_tables = random_tables(lens, max_blocks, num_blocks, gen)
        fill_cache(k_cache, new_tables, lens, gen)
        fill_cache(v_cache, new_tables, lens, gen)
        tables.copy_(new_tables)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        want = decode_reference(q, k_cache, v_cache, tables, seq_lens, scale)
        torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 4)])
def test_prefill_matches_reference(dtype, head_dim, num_heads, num_kv_heads):
    # (seq_len, q_len): fresh prompts, chunks after cached context, a one-token step
    cases = [(1000, 1000), (3000, 512), (17, 1), (2048, 37), (129, 129), (4096, 300)]
    lens = [n for n, _ in cases]
    q_lens = [m for _, m in cases]
    max_blocks = 4096 // BLOCK_SIZE + 3
    gen, k_cache, v_cache, tables = setup(lens, num_heads, num_kv_heads, head_dim, dtype,
                                          max_blocks, seed=head_dim)
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, max(q_lens), scale, out)
    want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,softcap", [(None, None), (300, 30.0)])
@pytest.mark.parametrize("num_decode_rows", [0, 5, 7])
def test_step_attention_with_decode_rows_matches_reference(dtype, window, softcap, num_decode_rows):
    """A mixed step: the first num_decode_rows sequences decode (one query each, contexts up to 3,000), then
    prompt chunks; the decode rows by the decode kernel, the chunks by the prefill kernel, every row as the
    reference (7: no chunk at all)."""
    decode = [(n, 1) for n in (3000, 1, 17, 700, 1024, 64, 2048)][:num_decode_rows]
    chunks = [(1000, 1000), (2048, 37), (129, 129), (4096, 300)] if num_decode_rows < 7 else []
    cases = decode + chunks
    lens, q_lens = [n for n, _ in cases], [m for _, m in cases]
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    gen, k_cache, v_cache, tables = setup(lens, num_heads, num_kv_heads, head_dim, dtype, 4096 // BLOCK_SIZE + 3,
                                          seed=num_decode_rows)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_step_attention(q, k_cache, v_cache, tables, seq_lens, qsl, max(q_lens), num_decode_rows, scale, out,
                         window=window, softcap=softcap)
    want = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])
