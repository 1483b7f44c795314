"""The paged GPU adapter pool (on the CPU here): packing, memory at an adapter's own rank, stale pages,
and the manager's bookkeeping under 10,000 random load / evict / request events."""
import random
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from loraserve.config import LoRAConfig
from loraserve.errors import InvalidRequestError
from loraserve.forward_context import ForwardContext
from loraserve.kernels.lora_meta import PAGE_RANK
from loraserve.kernels.lora_ops import lora_apply, lora_apply_ref
from loraserve.kernels.lora_reference import gather_a, gather_b
from loraserve.lora.manager import IN_MEMORY, LoRAManager
import loraserve.lora.layers as loraserve_layers
import loraserve.lora.manager as manager_module
from loraserve.lora.peft_config import LoRAAdapterError
from loraserve.lora.pool import AdapterPacker, PageLayout
from loraserve.lora.runtime import POOL_STEPS, KVRoom, LoRARuntime
from loraserve.lora.synthetic import ALL_TARGETS, random_adapter
from loraserve.models.loader import open_model
from loraserve.models.synthetic import SYNTHETIC_CONFIGS

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def tiny_runtime(max_loras=8, max_rank=64, pages=None, **lora):
    """A LoRA runtime on synthetic:tiny (fp32, CPU) whose pool holds `pages` pages of every page block, i.e.
    room for `pages` * PAGE_RANK rank rows on every LoRA layer (default: its CPU default)."""
    def build(config):
        return LoRARuntime(open_model("synthetic:tiny").load(torch.device("cpu"), torch.float32).model, config, 64,
                           None)

    config = LoRAConfig(max_loras=max_loras, max_lora_rank=max_rank, **lora)
    if pages is None:
        return build(config)
    layout = build(config).pool.layout
    page_bytes = layout.page_elems * torch.float32.itemsize
    return build(replace(config, lora_gpu_memory=(pages * layout.num_blocks + 0.5) * page_bytes / 2**30))


def test_packed_adapters_read_back_from_their_pages():
    """Adapters of ranks 3..64, all projections or q/k/v/o only, loaded into scattered pages: every layer's
    A and B gathered from the pool equal the adapter's, and the adapter's own ranks are recorded per layer."""
    runtime = tiny_runtime(pages=40)
    pool = runtime.pool
    loaded = []
    for i, (rank, targets) in enumerate([(16, ALL_TARGETS), (3, QKVO), (64, ALL_TARGETS), (9, QKVO)]):
        adapter = random_adapter(runtime.spec, f"a{i}", rank, targets, seed=i)
        adapter_id, _ = runtime.load(runtime.pack(adapter))
        loaded.append((adapter_id, adapter, targets))
        if i == 0:  # free a hole so that the next adapters' pages are not in order
            runtime.release(adapter_id)
            loaded.pop()
    for adapter_id, adapter, targets in loaded:
        rank = adapter.max_rank
        for i, (layer_index, layer) in enumerate(runtime.layers):
            pages = pool.block_tables[layer.page_block][adapter_id, :-(-rank // PAGE_RANK)]
            targeted = any((layer_index, m) in adapter.weights for m in layer.slice_names)
            assert int(layer.lora_rank[adapter_id]) == (rank if targeted else 0)
            if not targeted:
                continue
            a = gather_a(layer.lora_a, pages, len(layer.slice_names), rank)  # [S, r, in]
            b = gather_b(layer.lora_b, pages, rank)  # [r, N]
            for s, module in enumerate(layer.slice_names):
                lo, hi = layer.slice_offsets[s], layer.slice_offsets[s + 1]
                want = adapter.weights.get((layer_index, module))
                if want is None:
                    assert not a[s].any() and not b[:, lo:hi].any()
                else:
                    assert torch.equal(a[s], want[0]) and torch.equal(b[:, lo:hi], want[1].T)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_b_is_scaled_as_it_is_packed_rounded_once_like_an_upcast_b(model_dtype, file_dtype):
    """An adapter read with B and its scale kept apart packs to the same bytes as the adapter whose B was
    scaled in float32 first (B upcast, times the scale, rounded once to the model's dtype when packed), for
    every file and model dtype, scales that are not powers of two included."""
    spec = tiny_runtime().spec
    layout = tiny_runtime().pool.layout
    raw = random_adapter(spec, "raw", 12, ALL_TARGETS, seed=3, std=3.0).to(dtype=file_dtype)
    scales = {key: (2.0, 1 / 3, 0.70710678, 4.0, 1.0)[i % 5] for i, key in enumerate(raw.weights)}
    scaled = replace(raw, scales={k: v for k, v in scales.items() if v != 1.0})
    upcast = replace(raw, weights={k: (a, b.to(torch.float32) * scales[k] if scales[k] != 1.0 else b)
                                   for k, (a, b) in raw.weights.items()})
    packer = AdapterPacker(layout, tiny_runtime().packer.layers, model_dtype)
    got, want = packer.pack(scaled).data, packer.pack(upcast).data
    assert got.dtype == model_dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got, packer.pack(raw).data)  # the scales changed the packed B


def test_mixed_ranks_take_pages_for_their_own_ranks():
    """A set of all-projection adapters of ranks 8, 16, 32 and 64 takes the pages of its own ranks in every page
    block (not max_lora_rank's), and a q/k/v/o adapter only the blocks of those layers."""
    runtime = tiny_runtime(pages=40)
    blocks = runtime.pool.layout.num_blocks
    for r in (8, 16, 32, 64):
        runtime.load(runtime.pack(random_adapter(runtime.spec, f"r{r}", r, seed=r)))
    assert runtime.pool.used_pages == (8 + 16 + 32 + 64) // PAGE_RANK * blocks
    used = runtime.pool.used_pages
    qkvo = random_adapter(runtime.spec, "qkvo", 16, QKVO, seed=1)
    runtime.load(runtime.pack(qkvo))
    qkvo_blocks = {runtime.pool.layout.block_of[i] for i, (_, layer) in enumerate(runtime.layers)
                   if layer.slice_names[0] in QKVO}
    assert runtime.pool.used_pages - used == 2 * len(qkvo_blocks) < 2 * blocks


def _shapes_of(config: dict) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """The LoRA layers (module attr, in, out, slice offsets) of a Llama-like model of `config`."""
    h, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv, dim = config.get("num_key_value_heads", heads), config.get("head_dim", h // heads)
    q, k = heads * dim, kv * dim
    return [layer for _ in range(config["num_hidden_layers"]) for layer in (
        ("qkv_proj", h, q + 2 * k, (0, q, q + k, q + 2 * k)), ("o_proj", q, h, (0, h)),
        ("gate_up_proj", h, 2 * inter, (0, inter, 2 * inter)), ("down_proj", inter, h, (0, h)))]


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3.2-1b", "qwen3-8b", "gemma-3-12b", "phi-3-mini"])
def test_page_blocks_hold_real_models_adapters_in_about_their_own_bytes(model):
    """The page layout of real models' shapes: an adapter on every layer takes at most 1.1x its own bytes (Llama-3-8B
    1.02x), and one on q/k/v/o at most 1.25x (Llama-3-8B 1.05x), whatever its rank (pages of PAGE_RANK rows)."""
    layers = _shapes_of(SYNTHETIC_CONFIGS[model])
    layout = PageLayout(layers)

    def ratio(kinds):
        blocks = {layout.block_of[i] for i, (attr, *_) in enumerate(layers) if attr in kinds}
        own = sum(PAGE_RANK * (i * (len(o) - 1) + n) for attr, i, n, o in layers if attr in kinds)
        return len(blocks) * layout.page_elems / own

    every, attention = ratio({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}), ratio({"qkv_proj", "o_proj"})
    assert every <= (1.02 if model == "llama-3-8b" else 1.1), every
    assert attention <= (1.05 if model == "llama-3-8b" else 1.25), attention


def test_a_partial_adapter_in_reused_pages_reads_no_stale_weights():
    """A q/k/v/o adapter loaded into pages that held an all-projection adapter: the MLP layers see rank 0 and
    the product equals the one of the adapter loaded into a fresh pool."""
    runtime = tiny_runtime(max_rank=16, pages=4)
    full = runtime.load(runtime.pack(random_adapter(runtime.spec, "full", 16, seed=1)))[0]
    runtime.release(full)
    partial = random_adapter(runtime.spec, "qkvo", 16, QKVO, seed=2)
    reused = runtime.load(runtime.pack(partial))[0]
    fresh_runtime = tiny_runtime(max_rank=16, pages=4)
    fresh = fresh_runtime.load(fresh_runtime.pack(partial))[0]
    for (_, layer), (_, fresh_layer) in zip(runtime.layers, fresh_runtime.layers):
        x_in = torch.randn(5, layer.in_features)
        ys = []
        for rt, lay, aid in ((runtime, layer, reused), (fresh_runtime, fresh_layer, fresh)):
            meta = rt.write_metadata(np.array([aid, -1, aid, aid, -1]))[lay.page_block]
            y = torch.zeros(5, lay.out_features)
            lora_apply_ref(x_in, y, lay.lora_a, lay.lora_b, lay.lora_rank, meta, lay.slice_offsets)
            ys.append(y)
        assert torch.equal(ys[0], ys[1])


def test_kernels_read_each_layers_page_block():
    """An adapter on every layer and one on q/k/v/o in scattered pages of a pool of several page blocks: in
    every LoRA layer the Triton kernels (interpreted on the CPU) and the torch reference, reading the layer's
    block columns of the page table, give each token the product of its own adapter's weights."""
    runtime = tiny_runtime(max_rank=16, pages=4)
    assert runtime.pool.layout.num_blocks > 1
    hole = runtime.load(runtime.pack(random_adapter(runtime.spec, "hole", 8, seed=3)))[0]
    every = random_adapter(runtime.spec, "every", 16, seed=4)
    every_id = runtime.load(runtime.pack(every))[0]
    runtime.release(hole)  # the next adapter takes its pages, before the ones after "every"'s
    qkvo = random_adapter(runtime.spec, "qkvo", 8, QKVO, seed=5)
    qkvo_id = runtime.load(runtime.pack(qkvo))[0]
    rows = [every, None, qkvo, every, qkvo, None]
    metas = runtime.write_metadata(np.array([every_id, -1, qkvo_id, every_id, qkvo_id, -1]))
    gen = torch.Generator().manual_seed(0)
    for layer_index, layer in runtime.layers:
        x = torch.randn(len(rows), layer.in_features, generator=gen)
        want = torch.zeros(len(rows), layer.out_features)  # each row: its adapter's x A^T B^T, slice by slice
        for t, adapter in enumerate(rows):
            for s, module in enumerate(layer.slice_names):
                pair = adapter.weights.get((layer_index, module)) if adapter is not None else None
                if pair is not None:
                    want[t, layer.slice_offsets[s]:layer.slice_offsets[s + 1]] = x[t] @ pair[0].T @ pair[1].T
        args = (layer.lora_a, layer.lora_b, layer.lora_rank, metas[layer.page_block], layer.slice_offsets)
        for apply in (lora_apply, lora_apply_ref):
            y = torch.zeros(len(rows), layer.out_features)
            apply(x, y, *args)
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
        assert want[0].abs().max() > 0  # every layer has a product to check


def test_page_blocks_no_adapter_of_the_step_targets_get_no_adapters_tiles():
    """The pool records which page blocks each id's adapter has weights in, and the step metadata reads it: in a
    step of a q/k/v/o adapter the MLP layers' metas get no adapters' tiles (their LoRA kernels then do nothing);
    with an adapter on every layer in the step every block gets its tiles; a released id targets nothing, and
    an adapter loaded under it again counts with its own blocks."""
    runtime = tiny_runtime(max_rank=16, pages=4)
    qkvo_id = runtime.load(runtime.pack(random_adapter(runtime.spec, "qkvo", 8, QKVO, seed=1)))[0]
    attention = {layer.page_block for _, layer in runtime.layers if layer.slice_names[0] in QKVO}
    assert 0 < len(attention) < runtime.pool.layout.num_blocks
    assert set(np.flatnonzero(runtime.pool.block_targets[qkvo_id])) == attention

    def blocks_with_adapters_tiles(ids):
        metas = runtime.write_metadata(np.array(ids))
        return {b for b, meta in enumerate(metas) if int(meta.tile_count(16)[0]) > 0}

    assert blocks_with_adapters_tiles([qkvo_id, -1, qkvo_id]) == attention
    assert {b for b, on in enumerate(runtime.for_step(np.array([qkvo_id, -1])).active) if on} == attention
    assert runtime.for_step(np.array([qkvo_id]), every_block=True).active is None  # the warm-up runs every block
    every_id = runtime.load(runtime.pack(random_adapter(runtime.spec, "every", 8, seed=2)))[0]
    everything = set(range(runtime.pool.layout.num_blocks))
    assert blocks_with_adapters_tiles([qkvo_id, every_id]) == everything
    assert blocks_with_adapters_tiles([-1, -1]) == set()
    runtime.release(qkvo_id)
    assert not runtime.pool.block_targets[qkvo_id].any()
    again = runtime.load(runtime.pack(random_adapter(runtime.spec, "every2", 8, seed=3)))[0]
    assert again == qkvo_id  # the released id, given again
    assert blocks_with_adapters_tiles([again]) == everything


def test_a_steps_adapters_lie_side_by_side_as_wide_as_their_largest_ranks():
    """The step metadata's slot_columns: each slot's first column when the step's adapters lie side by side,
    each as wide as its largest rank (the products as extra GEMM columns, lora/layers.py); the runtime's key of
    those columns changes when an id is given another adapter, so no layer keeps the old one's B beside W."""
    runtime = tiny_runtime(max_rank=32, pages=8)
    runtime.gemm_columns = True  # a CUDA runtime's setting (one GPU); the metadata and keys are host work
    ids = [runtime.load(runtime.pack(random_adapter(runtime.spec, f"a{r}", r, seed=r)))[0] for r in (8, 32, 16)]
    batch = runtime.for_step(np.array([ids[2], -1, ids[0], ids[1], ids[0]]))
    order = np.argsort(ids)  # slots follow the ids
    widths = np.array([8, 32, 16])[order]
    assert batch.step_columns == 56 and batch.num_slots == 3
    assert runtime.metadata.meta.slot_columns.tolist()[:4] == [0, int(widths[0]), int(widths[:2].sum()), 56]
    assert runtime.for_step(np.array([ids[0], ids[1], ids[2]])).columns_key == batch.columns_key
    assert runtime.for_step(np.array([-1, -1])).step_columns == 0  # no adapter: no columns
    # the largest rank of the step's adapters bounds the dots of the kernels that expand factors
    assert batch.step_rank == 32 and runtime.for_step(np.array([ids[0], -1, ids[2]])).step_rank == 16
    assert runtime.for_step(np.array([ids[0]]), step_rank=32).step_rank == 32  # the warm-up's, as asked
    runtime.gemm_columns = False
    assert runtime.for_step(np.array([ids[0], ids[0]])).step_rank == 8
    assert runtime.expand_widths() == (16, 32)
    runtime.gemm_columns = True
    runtime.release(ids[1])
    again = runtime.load(runtime.pack(random_adapter(runtime.spec, "b32", 32, seed=9)))[0]
    assert again == ids[1]
    assert runtime.for_step(np.array([ids[0], again, ids[2]])).columns_key != batch.columns_key


def test_products_inside_the_gemms_equal_in_place_and_follow_an_id_given_another_adapter(monkeypatch):
    """A LoRA layer whose input has columns of room (as the op before leaves them on one GPU) sums the step's
    products inside its GEMM: [x | z] @ [W | B]^T equals the base output plus the in-place reference product
    (fp32, the kernels in the interpreter). The step's B is placed beside W once per set of adapters: a step of
    the same adapters places nothing, and an id given another adapter places the new one's B."""
    runtime = tiny_runtime(max_rank=32, pages=8)
    for _, layer in runtime.layers:
        layer.enable_columns()
    runtime.gemm_columns = True  # a CUDA runtime's setting; here the kernels run in Triton's interpreter
    placed = []
    original = loraserve_layers.place_b

    def counted(*args, **kwargs):
        placed.append(args)
        original(*args, **kwargs)

    monkeypatch.setattr(loraserve_layers, "place_b", counted)
    ids = [runtime.load(runtime.pack(random_adapter(runtime.spec, f"a{r}", r, seed=r, std=0.2)))[0]
           for r in (8, 32, 16)]
    tokens = np.array([ids[0]] * 5 + [-1] * 3 + [ids[1]] * 4 + [ids[2]] * 6 + [ids[0]] * 2)
    gen = torch.Generator().manual_seed(5)
    _, layer = runtime.layers[0]  # q/k/v of the first decoder layer: three slices
    k = layer.in_features
    x = torch.randn(len(tokens), k, generator=gen)

    def both(token_ids):
        in_gemm = ForwardContext(None, runtime.for_step(token_ids))
        extra = layer.input_columns(in_gemm, len(token_ids))
        assert extra > 0
        roomy = torch.full((len(token_ids), k + extra), float("nan"))[:, :k]  # the op before's output
        roomy.copy_(x)
        got = layer(roomy, in_gemm)
        want = layer(x, ForwardContext(None, runtime.for_step(token_ids, in_gemms=False)))
        base = layer.base(x).y
        return got.y, want.y, base

    got, want, base = both(tokens)
    assert len(placed) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lora_rows = torch.from_numpy(tokens >= 0)
    assert (want - base)[lora_rows].abs().max() > 1e-2  # the products are there
    assert torch.equal(want[~lora_rows], base[~lora_rows])
    got, want, _ = both(tokens[::-1].copy())  # the same adapters in other rows: their B stays beside W
    assert len(placed) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    runtime.release(ids[1])
    assert runtime.load(runtime.pack(random_adapter(runtime.spec, "b32", 32, seed=9, std=0.2)))[0] == ids[1]
    got, want, _ = both(tokens)
    assert len(placed) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_adapter_that_overflows_float16_once_scaled_is_refused():
    """A float16 model: B * scale past float16's range fails the adapter at packing, naming it (no Inf in the
    pool, where the products inside the GEMMs would spread it to other rows)."""
    runtime = tiny_runtime()
    packer = replace(runtime.packer, dtype=torch.float16)
    assert packer.pack(random_adapter(runtime.spec, "fine", 8, seed=2)).data.dtype == torch.float16
    adapter = random_adapter(runtime.spec, "huge", 8, seed=1)
    key = next(iter(adapter.weights))
    a, b = adapter.weights[key]
    adapter.weights[key] = (a, b * 1e8)  # finite in the file's float32
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'huge'.*overflow float16"):
        packer.pack(adapter)


def test_layers_no_adapter_of_the_step_has_weights_in_run_no_lora_kernels(monkeypatch):
    """In an eager pass the layers of page blocks that no adapter of the step targets return the base output and
    launch no LoRA product; the others add theirs (equal to the reference); with every_block (the warm-up)
    every layer runs the LoRA product."""
    runtime = tiny_runtime(max_rank=16, pages=4)
    qkvo_id = runtime.load(runtime.pack(random_adapter(runtime.spec, "qkvo", 8, QKVO, seed=1)))[0]
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        lora_apply_ref(*args, **kwargs)

    monkeypatch.setattr("loraserve.lora.layers.lora_apply_ref", counted)
    ids = np.array([qkvo_id, -1, qkvo_id])
    gen = torch.Generator().manual_seed(0)
    for every_block in (False, True):
        batch = runtime.for_step(ids, every_block)
        for _, layer in runtime.layers:
            x = torch.randn(len(ids), layer.in_features, generator=gen)
            calls.clear()
            out = layer(x, ForwardContext(None, batch))
            base = layer.base(x).y
            targeted = layer.slice_names[0] in QKVO
            assert len(calls) == (1 if targeted or every_block else 0), (layer.slice_names, every_block)
            if targeted:
                assert not torch.allclose(out.y[0], base[0])  # the adapter's product is added
                assert torch.equal(out.y[1], base[1])  # the base token's row is the base output
            else:
                assert torch.equal(out.y, base)


def test_a_pool_smaller_than_one_max_rank_adapter_is_refused():
    with pytest.raises(ValueError, match="max_lora_rank"):
        tiny_runtime(max_rank=64, pages=7)


def test_the_default_pool_takes_its_share_or_what_the_kv_cache_can_never_use_up_to_two_steps_of_adapters():
    """Without lora_gpu_memory the pool is DEFAULT_POOL_SHARE of the KV cache's room, or, where max_num_seqs
    sequences of max_model_len can never use all that room, the rest up to room for POOL_STEPS steps of max_loras
    adapters of max rank."""
    def model():  # each runtime wraps its model's layers
        return open_model("synthetic:tiny").load(torch.device("cpu"), torch.float32).model

    config = LoRAConfig(max_loras=8, max_lora_rank=16)
    pool = LoRARuntime(model(), config, 64, None).pool  # the CPU default: room for max_loras adapters of max rank
    one = pool.max_adapter_pages * pool.page_bytes  # an adapter of max rank on every layer
    # (KV room, KV bytes ever used) in max-rank adapters -> adapters the pool holds
    for available, useful, want in ((100, 90, 22), (20, 10, 10), (40, 10, POOL_STEPS * 8)):
        room = KVRoom(available * one, useful * one)
        pages = LoRARuntime(model(), config, 64, None, kv_room=room).pool.num_pages
        assert pages * pool.page_bytes // one == want, (available, useful)


def test_the_manager_never_leaks_pages_under_random_events():
    """10,000 random events over 40 in-memory adapters of ranks 4..64 in a 24-page pool: steps of up to 4
    adapters, requests starting and finishing, adapters unregistered and registered again, pins, load-ahead.
    After every event: used pages = the resident adapters' pages, no page is held twice, running adapters stay
    resident, and the host cache stays within its count."""
    runtime = tiny_runtime(max_loras=4, pages=24, max_cpu_loras=10)
    manager = LoRAManager(runtime)
    pool = runtime.pool
    rng = random.Random(0)
    ranks = {f"a{i}": rng.choice([4, 8, 16, 32, 64]) for i in range(40)}
    adapters = {name: random_adapter(runtime.spec, name, r, seed=i) for i, (name, r) in enumerate(ranks.items())}
    for name, adapter in adapters.items():
        manager.register_adapter(name, adapter)
    running: dict[str, int] = {}  # adapter -> requests in flight
    retired: set[str] = set()  # unregistered while requests ran

    def check():
        held = [p for pages in pool._pages_of.values() for p in pages]
        assert len(held) == len(set(held)) == pool.used_pages
        assert pool.used_pages == sum(manager.pages_of(n) for n in manager.resident_on_gpu)
        assert set(running) <= set(manager.resident_on_gpu)
        assert len(manager.resident_on_cpu) <= 10 + len(manager.pinned)

    for _ in range(10_000):
        event = rng.random()
        if event < 0.45:  # a step: new adapters join the running ones if they fit
            names = set(running)
            for name in rng.sample(sorted(manager.registered()), 3):
                pages = sum(manager.pages_of(n) for n in names | {name} | manager.pinned)
                if len(names | manager.pinned | {name}) <= 4 and pages <= pool.num_pages:
                    names.add(name)
            manager.prepare(names, set(running))
            for name in names & set(manager.registered()) - set(running):  # new requests (retired adapters take none)
                manager.acquire(name)
                running[name] = running.get(name, 0) + 1
        elif event < 0.75 and running:  # a request finishes
            name = rng.choice(sorted(running))
            manager.release(name)
            running[name] -= 1
            if not running[name]:
                del running[name]
                if name in retired:  # its last request finished: the name may be registered again
                    retired.discard(name)
                    manager.register_adapter(name, adapters[name])
        elif event < 0.85:  # unregister and register again (maybe while requests run)
            name = rng.choice(sorted(manager.registered()))
            if name not in manager.pinned:
                manager.unregister(name)
                if name in running:
                    retired.add(name)
                else:
                    manager.register_adapter(name, adapters[name])
        elif event < 0.95:  # load-ahead of some waiting adapters
            manager.prefetch(rng.sample(sorted(manager.registered()), 4), set(running))
        elif not manager.pinned:  # pin an adapter (refused when the pool has no room for it now)
            name = rng.choice(sorted(manager.registered()))
            try:
                manager.register(name, IN_MEMORY, pinned=True)
            except InvalidRequestError as exc:
                assert "can't pin" in str(exc)
        check()
    assert manager.num_gpu_evictions > 100 and manager.num_gpu_loads > 100
    for name, count in list(running.items()):
        for _ in range(count):
            manager.release(name)
    running.clear()
    check()
    assert not manager.refcounts


def test_reads_ahead_stop_at_the_host_caches_room_and_push_out_nothing_awaited():
    """Eight waiting adapters, a pool of two and a host cache of about three and a half: the load-ahead puts two
    in the pool and reads three more, then stops (a fourth would push out one that a waiting request still
    needs); every adapter read is then in the pool or the host cache, never read twice. Once the pool's two
    are evicted for others, the reads go on."""
    probe = LoRAManager(tiny_runtime(max_loras=4, max_rank=16))  # for an adapter's host bytes
    one = probe._read_bytes(probe.pool.layout.pages_for(16))
    probe.close()
    pages = 2 * 16 // PAGE_RANK  # of every page block: two adapters of rank 16 on every layer
    runtime = tiny_runtime(max_loras=4, max_rank=16, pages=pages, max_cpu_lora_memory=3.5 * one / 2**30)
    manager = LoRAManager(runtime)
    names = [f"a{i}" for i in range(8)]
    for i, name in enumerate(names):
        manager.register_adapter(name, random_adapter(runtime.spec, name, 16, seed=i))
        manager.acquire(name)  # a waiting request
    try:
        for _ in range(50):
            manager.prefetch(names, protected=set(), idle=True)
        assert len(manager.resident_on_gpu) == 2
        read = set(manager.resident_on_gpu) | set(manager.resident_on_cpu)
        assert manager.num_loads == len(read) == 5, (manager.num_loads, read)
        assert all(manager.is_ready(n) for n in read) and not any(manager.is_ready(n) for n in set(names) - read)
        for name in list(manager.resident_on_gpu):  # their requests ran and finished
            manager.release(name)
        manager.prepare(set(names[2:4]), running=set())  # two others come into the pool
        for _ in range(50):
            manager.prefetch(names[4:], protected=set(names[2:4]), idle=True)
        assert manager.num_loads == 7  # two more read: the room the pool's new adapters left in the host cache
    finally:
        manager.close()


def test_a_worker_that_finishes_a_read_starts_the_next_without_waiting_for_a_step(monkeypatch):
    """With reader processes, reads are queued behind the running ones (READ_QUEUE_FACTOR per process): after
    one load-ahead call with one waiting adapter more than that, one worker reads them one after another without
    another call (the next step), all but the last, which is not started until a call finds room for it. The
    thread reader, whose reads hold the interpreter lock, starts one at a time."""
    monkeypatch.setattr(manager_module, "read_workers", lambda: 1)
    thread_reader = LoRAManager(tiny_runtime(max_loras=4, max_rank=16, lora_reader="thread"))
    assert thread_reader._read_depth == 1
    thread_reader.close()
    manager = LoRAManager(tiny_runtime(max_loras=8, max_rank=16, lora_reader="process"))
    assert manager.read_slots == 1 and manager_module.READ_QUEUE_FACTOR >= 2
    names = [f"a{i}" for i in range(manager_module.READ_QUEUE_FACTOR + 1)]
    for i, name in enumerate(names):
        manager.register_adapter(name, random_adapter(manager.runtime.spec, name, 16, seed=i))
        manager.acquire(name)  # a waiting request
    started = {name: threading.Event() for name in names}
    release_first = threading.Event()
    read = manager._read

    def observed_read(name, entry):
        started[name].set()
        if name == names[0]:
            assert release_first.wait(10)  # the first read runs until the others have been queued
        return read(name, entry)

    manager._read = observed_read
    try:
        manager.prefetch(names, protected=set())
        assert started[names[0]].wait(10)
        assert not started[names[1]].is_set()  # queued behind the first: one worker
        release_first.set()
        for name in names[1:-1]:
            assert started[name].wait(10)  # each started when the one before finished, with no call in between
        assert not started[names[-1]].is_set()
        manager.prefetch(names, protected=set(), idle=True)
        assert started[names[-1]].wait(10)
    finally:
        release_first.set()
        manager.close()
