"""LoRA products as extra columns of the base GEMM (kernels/lora_columns.py), fp32, small sizes: place_factors
and place_b against plain indexing (pool pages past each adapter's rank are NaN, the shrink's output NaN where
it must not be read), and [x | z] @ [W | B]^T against the base GEMM plus the in-place LoRA reference. Without
CUDA the kernels run in Triton's interpreter (tests/conftest.py)."""
import numpy as np
import pytest
import torch

from test_lora_kernels import DEVICE, assign_slots, make_weights, offsets_of
from loraserve.kernels.lora_columns import COLUMN_ALIGN, padded_columns, place_b, place_factors
from loraserve.kernels.lora_reference import place_b_ref, place_factors_ref
from loraserve.kernels.lora_ops import lora_apply_ref, lora_factors
from loraserve.lora.metadata import LoRAMetaBuilder

# hidden, slice sizes, rank_max, adapters, tokens, base fraction
CASES = [
    (64, (64, 32, 32), 16, 3, 40, 0.2),  # q/k/v-like, three slices
    (48, (80, 80), 8, 4, 33, 0.0),  # gate/up-like, every token with an adapter
    (96, (40,), 24, 2, 17, 0.5),  # o/down-like; a width that is no tile multiple
    (32, (64, 16, 16), 16, 1, 5, 1.0),  # only base tokens: every extra column zero
]


def _case(seed, hidden, sizes, rank_max, num_loras, num_tokens, base):
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    ranks = [int(r) for r in rng.integers(1, rank_max + 1, num_loras)]
    ranks[0] = rank_max
    pool = make_weights(num_loras, sizes, rank_max, hidden, ranks, torch.float32, DEVICE, gen)
    num_ids = num_loras + 2
    adapter_ranks = np.zeros(num_ids, dtype=np.int32)  # each id's columns: wider than this layer's rank for some
    for slot, adapter in enumerate(pool["ids"]):
        adapter_ranks[adapter] = ranks[slot] + (8 if slot % 2 else 0)
    builder = LoRAMetaBuilder(num_tokens + 3, num_loras, pool["table"], None, adapter_ranks)
    slots = assign_slots("uniform", num_tokens, np.arange(num_loras), base, rng)
    ids = np.asarray(pool["ids"] + [-1], dtype=np.int64)[slots]
    meta = builder.build(ids)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    return pool, ranks, slots, meta, builder, x, gen


@pytest.mark.parametrize("case", CASES)
def test_place_factors_writes_each_tokens_product_in_its_slots_columns(case):
    hidden, sizes, rank_max, num_loras, num_tokens, base = case
    pool, ranks, slots, meta, builder, x, gen = _case(1, *case)
    num_slices, width = len(sizes), meta.rank_width
    inter = torch.full((num_tokens, num_slices, width), float("nan"))  # NaN wherever it must not be read
    for t, slot in enumerate(slots):
        if slot >= 0:
            inter[t, :, :ranks[slot]] = torch.randn(num_slices, ranks[slot], generator=gen)
    inter = inter.view(num_tokens, -1).to(DEVICE)
    extra = padded_columns(num_slices, builder.step_columns) if builder.step_columns else COLUMN_ALIGN
    step_columns = max(builder.step_columns, 1)
    x_aug = torch.full((num_tokens, hidden + extra), 7.0, device=DEVICE)
    x_aug[:, :hidden] = x
    place_factors(inter, meta, pool["rank"], step_columns, x_aug, hidden)
    want = place_factors_ref(inter.cpu(), meta.token_slots[:num_tokens].cpu(), meta.slot_adapter.cpu(),
                             meta.slot_columns.cpu(), pool["rank"].cpu(), width, num_slices, step_columns, extra)
    assert torch.equal(x_aug[:, :hidden], x)
    assert torch.equal(x_aug[:, hidden:].cpu(), want)
    if base < 1.0:
        assert want.abs().sum() > 0  # the case has products to place


@pytest.mark.parametrize("case", CASES[:3])
def test_place_b_writes_each_slots_b_in_its_slices_rows(case):
    hidden, sizes, rank_max, num_loras, num_tokens, base = case
    pool, ranks, slots, meta, builder, x, gen = _case(2, *case)
    num_slices, n_out = len(sizes), sum(sizes)
    offsets = offsets_of(sizes)
    max_columns = padded_columns(num_slices, builder.step_columns) + COLUMN_ALIGN
    w = torch.randn(n_out, hidden, generator=gen).to(DEVICE)
    w_aug = torch.full((n_out, hidden + max_columns), 5.0, device=DEVICE)
    w_aug[:, :hidden] = w
    offsets_dev = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    place_b(pool["b"], meta, pool["rank"], offsets_dev, builder.step_adapters.size, builder.step_columns, w_aug, hidden)
    slot_adapter = meta.slot_adapter.tolist()[:builder.step_adapters.size]
    b_t = [pool["dense_b"][pool["ids"].index(a)][:, :ranks[pool["ids"].index(a)]].t() for a in slot_adapter]
    used = num_slices * builder.step_columns
    want = place_b_ref(b_t, meta.slot_columns.tolist(), list(offsets), n_out, builder.step_columns, used)
    assert torch.equal(w_aug[:, :hidden], w)
    assert torch.equal(w_aug[:, hidden:hidden + used].cpu(), want)
    assert bool((w_aug[:, hidden + used:] == 5.0).all())  # past the step's columns: untouched


@pytest.mark.parametrize("case", CASES)
def test_the_gemm_over_extra_columns_adds_each_tokens_lora_product(case):
    """[x | z] @ [W | B]^T with the shrink's z equals x @ W^T plus the in-place reference product."""
    hidden, sizes, rank_max, num_loras, num_tokens, base = case
    pool, ranks, slots, meta, builder, x, gen = _case(3, *case)
    num_slices, n_out = len(sizes), sum(sizes)
    offsets = offsets_of(sizes)
    step_columns = max(builder.step_columns, 1)
    extra = padded_columns(num_slices, step_columns)
    w = (torch.randn(n_out, hidden, generator=gen) / hidden ** 0.5).to(DEVICE)
    w_aug = torch.zeros(n_out, hidden + extra, device=DEVICE)  # padding: x_aug's zeros meet it
    w_aug[:, :hidden] = w
    w_aug[:, hidden:hidden + num_slices * builder.step_columns] = float("nan")  # all of it written by place_b
    x_aug = torch.empty(num_tokens, hidden + extra, device=DEVICE)
    x_aug[:, :hidden] = x
    factors = lora_factors(x_aug[:, :hidden], pool["a"], pool["b"], pool["rank"], meta, offsets)
    place_factors(factors.inter, meta, pool["rank"], step_columns, x_aug, hidden)
    offsets_dev = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    place_b(pool["b"], meta, pool["rank"], offsets_dev, builder.step_adapters.size, step_columns, w_aug, hidden)
    got = x_aug @ w_aug.t()
    want = x @ w.t()
    lora_apply_ref(x, want, pool["a"], pool["b"], pool["rank"], meta, offsets)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    lora_rows = torch.from_numpy(slots >= 0).to(DEVICE)
    if lora_rows.any():
        assert (want[lora_rows] - x[lora_rows] @ w.t()).abs().max() > 1e-2  # the product is not negligible
