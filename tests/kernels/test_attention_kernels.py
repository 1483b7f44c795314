"""CPU tests of paged attention: the torch reference and the Triton kernels (interpreter, fp32).

Every result is checked against a naive float64 loop over dense, unpaged K/V;
the paged caches use shuffled block ids and are NaN everywhere no token lives,
so reading a wrong slot or an unmasked tail shows up as a mismatch.
"""
import pytest
import torch

from loraserve.kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    paged_decode_attention,
    paged_prefill_attention,
    paged_step_attention,
)
from loraserve.kernels.attention_reference import paged_attention_ref, write_kv_cache


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen):
    """Dense per-sequence K/V ([L, KVH, D] each) and the same tokens in a shuffled paged cache."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one spare column, never referenced by a real token
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Unused table entries point at a NaN block: reading them would poison the output.
    block_tables = torch.full((len(seq_lens), max_blocks), perm[-1], dtype=torch.int32)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ids = [perm.pop(0) for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(n):
            k_cache[ids[pos // block_size], pos % block_size] = k[pos]
            v_cache[ids[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k)
        dense_v.append(v)
    return dense_k, dense_v, k_cache, v_cache, block_tables


def naive_attention(q, dense_k, dense_v, seq_lens, q_lens, scale, window=None, softcap=None):
    """Float64 loop: query i of sequence s sits at position p = L-q_len+i and sees keys 0..p (with a window:
    the last `window` of them); scores are scaled, then soft-capped (softcap * tanh(score / softcap))."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for k, v, seq_len, q_len in zip(dense_k, dense_v, seq_lens, q_lens):
        group = num_heads // k.shape[1]
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                keys = k[first: pos + 1, h // group].double()  # [n, D]
                vals = v[first: pos + 1, h // group].double()  # [n, D]
                scores = keys @ q[row + i, h].double() * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                out[row + i, h] = torch.softmax(scores, dim=0) @ vals
        row += q_len
    return out


def qsl_of(q_lens):
    return torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)


def test_write_kv_cache_stores_each_token_at_its_slot():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    k = torch.randn(7, kvh, d, generator=gen)
    v = torch.randn(7, kvh, d, generator=gen)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, block_size)
        assert torch.equal(k_cache[blk, off], k[t]) and torch.equal(v_cache[blk, off], v[t])
        written[blk, off] = True
    assert torch.equal(k_cache[~written], before_k[~written])
    assert torch.equal(v_cache[~written], before_v[~written])


@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_matches_naive_dense_attention(block_size):
    gen = torch.Generator().manual_seed(1)
    # (seq_len, q_len): full prefill, chunked prefill with context, decode, one-token prompt,
    # a decode padding row (no context: zeros)
    seq_lens, q_lens = [7, 19, 33, 1, 16, 0], [7, 5, 1, 1, 16, 1]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, 2, 16, block_size,
                                                            torch.float32, gen)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    got = paged_attention_ref(q, k_cache, v_cache, tables,
                              torch.tensor(seq_lens, dtype=torch.int32), qsl_of(q_lens), 0.25)
    want = naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,head_dim", [(4, 16), (16, 32)])
def test_decode_kernel_matches_naive(num_splits, block_size, head_dim):
    gen = torch.Generator().manual_seed(2)
    seq_lens = [0, 1, 17, 70, 5, 0]  # 0 = graph padding row
    num_heads, num_kv_heads = 4, 2
    live = [n for n in seq_lens if n]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(
        [max(n, 1) for n in seq_lens], num_kv_heads, head_dim, block_size, torch.float32, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                           0.3, out, DecodeConfig(num_splits=num_splits, block_n=16))
    rows = [i for i, n in enumerate(seq_lens) if n]
    want = naive_attention(q[rows], [dense_k[i] for i in rows], [dense_v[i] for i in rows],
                           live, [1] * len(live), 0.3)
    torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)
    pad = [i for i, n in enumerate(seq_lens) if not n]
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@pytest.mark.parametrize("config", [PrefillConfig(block_m=16, block_n=16), PrefillConfig()])
def test_prefill_kernel_matches_naive(config):
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    # fresh prompt, chunk after 33 cached tokens, no queries this step, decode-like, long chunk
    seq_lens, q_lens = [5, 40, 12, 9, 70], [5, 7, 0, 1, 37]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, num_kv_heads, head_dim,
                                                            block_size, torch.float32, gen)
    total = sum(q_lens)
    # q as a strided view of a packed qkv projection, as the model produces it
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                            qsl_of(q_lens), max(q_lens), 0.25, out, config)
    want = naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.25)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first_seq", [1, 3, 5])
def test_prefill_kernel_from_a_first_sequence(first_seq):
    """first_seq: only the sequences from it on are attended (their rows equal the naive loop's), the rows of
    those before are not written; the arrays are the whole ones, not views from first_seq."""
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    seq_lens, q_lens = [9, 17, 5, 40, 12], [1, 1, 5, 7, 3]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, num_kv_heads, head_dim,
                                                            block_size, torch.float32, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                            qsl_of(q_lens), max(q_lens), 0.25, out, PrefillConfig(block_m=16, block_n=16),
                            first_seq=first_seq)
    first_row = sum(q_lens[:first_seq])
    want = naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.25)
    torch.testing.assert_close(out[first_row:].double(), want[first_row:], atol=1e-5, rtol=1e-5)
    assert out[:first_row].isnan().all()
    with pytest.raises(ValueError, match="first_seq"):
        paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                qsl_of(q_lens), max(q_lens), 0.25, out, first_seq=len(seq_lens) + 1)


@pytest.mark.parametrize("num_decode_rows", [0, 1, 3, 5])
def test_step_attention_of_decode_rows_and_chunks(num_decode_rows):
    """A step of decode rows (one query each, first) and prompt chunks: the decode kernel takes the rows, the
    prefill kernel the chunks; every row equals the naive loop's."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    seq_lens = [9, 17, 33, 16, 21, 40, 12]
    q_lens = [1] * num_decode_rows + [5, 7, 3, 12, 2, 9, 4][num_decode_rows:]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, num_kv_heads, head_dim,
                                                            block_size, torch.float32, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_step_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl_of(q_lens),
                         max(q_lens), num_decode_rows, 0.25, out,
                         (DecodeConfig(), PrefillConfig(block_m=16, block_n=16)))
    want = naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.25)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# (window, softcap): windows shorter and longer than a key tile (16 here) and than a query tile, one not a
# multiple of the block size; a softcap small enough to change the scores (Gemma 2 uses 50 on scores of a
# larger scale)
WINDOW_CASES = [(5, None), (16, None), (23, 2.0), (None, 1.5), (40, None)]


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
def test_reference_with_window_and_softcap_matches_naive(window, softcap):
    gen = torch.Generator().manual_seed(5)
    seq_lens, q_lens = [30, 45, 9, 70, 0], [30, 6, 1, 37, 1]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, 2, 16, 4, torch.float32, gen)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    got = paged_attention_ref(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                              qsl_of(q_lens), 0.3, window, softcap)
    rows = sum(q_lens[:-1])  # the last sequence is a padding row (zeros)
    want = naive_attention(q[:rows], dense_k[:-1], dense_v[:-1], seq_lens[:-1], q_lens[:-1], 0.3, window, softcap)
    torch.testing.assert_close(got[:rows].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[rows:], torch.zeros_like(got[rows:]))


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_with_window_and_softcap(window, softcap, num_splits):
    gen = torch.Generator().manual_seed(6)
    seq_lens = [70, 1, 33, 0, 16]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged([max(n, 1) for n in seq_lens], 2, 16, 4,
                                                            torch.float32, gen)
    q = torch.randn(len(seq_lens), 4, 16, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3, out,
                           DecodeConfig(num_splits=num_splits, block_n=16), window=window, softcap=softcap)
    rows = [i for i, n in enumerate(seq_lens) if n]
    want = naive_attention(q[rows], [dense_k[i] for i in rows], [dense_v[i] for i in rows],
                           [seq_lens[i] for i in rows], [1] * len(rows), 0.3, window, softcap)
    torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
def test_prefill_kernel_with_window_and_softcap(window, softcap):
    gen = torch.Generator().manual_seed(7)
    # fresh prompts longer than the windows, a chunk after cached context, a decode-like row
    seq_lens, q_lens = [70, 60, 9, 33], [70, 21, 1, 33]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, 2, 16, 4, torch.float32, gen)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl_of(q_lens),
                            max(q_lens), 0.3, out, PrefillConfig(block_m=16, block_n=16), window=window,
                            softcap=softcap)
    want = naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_kernels_serve_a_head_dim_that_is_not_a_power_of_two():
    """Phi-3's head_dim 96 (here 24): padded to 32 inside the kernels."""
    gen = torch.Generator().manual_seed(8)
    seq_lens, q_lens = [21, 40], [21, 8]
    dense_k, dense_v, k_cache, v_cache, tables = make_paged(seq_lens, 1, 24, 4, torch.float32, gen)
    q = torch.randn(sum(q_lens), 2, 24, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl_of(q_lens),
                            max(q_lens), 0.2, out, PrefillConfig(block_m=16, block_n=16), window=10)
    torch.testing.assert_close(out.double(), naive_attention(q, dense_k, dense_v, seq_lens, q_lens, 0.2, 10),
                               atol=1e-5, rtol=1e-5)
    q1 = torch.randn(2, 2, 24, generator=gen)
    out1 = torch.full_like(q1, float("nan"))
    paged_decode_attention(q1, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.2, out1,
                           DecodeConfig(num_splits=2, block_n=16))
    torch.testing.assert_close(out1.double(), naive_attention(q1, dense_k, dense_v, seq_lens, [1, 1], 0.2),
                               atol=1e-5, rtol=1e-5)


def test_kernels_reject_mismatched_dtypes():
    k_cache = torch.zeros(2, 4, 1, 16)
    q = torch.zeros(1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q, k_cache, k_cache, torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0, torch.zeros_like(q))
