"""GPU: LoRA inside the decode graphs and the graphs of steps that prefill (marked gpu).

Graph output equals eager output for every bucket and 0, 1, k and max_loras
active adapters with base rows mixed in and mixed ranks; adapter rows differ
from base rows (a graph that dropped LoRA fails); adapters loaded or replaced
after capture take effect at the next step; graphs + LoRA match PEFT in bf16.
"""
import dataclasses
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from decode_batch import random_decode_inputs
from hf_reference import is_greedy_of, load_peft_model, teacher_forced_logprobs
from model_fixtures import CONFIDENT_STEPS, make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.forward_context import AttentionMetadata, ForwardContext
import loraserve.lora.layers as loraserve_layers
from loraserve.lora.metadata import LoRAMetaBuilder
from loraserve.lora.runtime import LoRABatch
from loraserve.lora.synthetic import random_adapter
from loraserve.worker.graph_check import probe_prefill_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_common import time_capture  # noqa: E402 (the benchmarks' capture timer)

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = [{"name": f"a{i}", "r": r, "lora_alpha": 2 * r, "target_modules": TARGETS}
         for i, r in enumerate([4, 8, 16, 2])]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory("llama", train_steps=CONFIDENT_STEPS)
    # adapters that change the output clearly but keep the trained model's margins (std 0.05, not 0.1)
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("gpu-adapters"), SPECS, seed=3, std=0.05)
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=40, enable_lora=True,
              max_loras=4, max_lora_rank=16)
    for spec, path in zip(SPECS, paths):
        llm.add_lora(LoRARequest(spec["name"], path))
    return folder, dict(zip([s["name"] for s in SPECS], paths)), llm


def _probe(llm, n, token_slots, seed):
    """Run one decode batch through the graph and eagerly on the same inputs; returns (graph, eager, base)."""
    runner = llm.engine.runner
    gr = runner.graph_runner
    rng = np.random.default_rng(seed)
    inputs = random_decode_inputs(rng, n, runner.block_size, llm.engine.hf_config.vocab_size, token_slots)
    graph = gr.replay(inputs).clone()

    def eager(lora_ids):
        dev = torch.device("cuda")
        attn = AttentionMetadata(torch.from_numpy(inputs.slot_mapping).to(dev),
                                 torch.from_numpy(inputs.block_tables).to(dev), torch.from_numpy(inputs.seq_lens).to(dev),
                                 torch.arange(n + 1, dtype=torch.int32, device=dev), 1, True)
        # LoRA products in place (no side stream), on the unpadded batch
        lora = LoRABatch(runner.lora.write_metadata(np.asarray(lora_ids)), None) if lora_ids is not None else None
        return runner.model(torch.from_numpy(inputs.input_ids).to(dev), torch.from_numpy(inputs.positions).to(dev),
                            ForwardContext(attn, lora)).clone()

    with torch.inference_mode():
        return graph, eager(token_slots), eager(None)


def test_graph_equals_eager_for_every_bucket_and_adapter_mix(setup):
    _, _, llm = setup
    manager = llm.engine.lora_manager
    slots = manager.prepare({"a0", "a1", "a2", "a3"}, set())
    all_slots = [slots[n] for n in ["a0", "a1", "a2", "a3"]]
    gr = llm.engine.runner.graph_runner
    assert sorted(gr.graphs) == gr.buckets, "a bucket failed the start-up integrity check"
    for bucket in gr.buckets:
        for active in (0, 1, 2, 4):
            n = max(1, bucket - 1) if bucket > 1 else 1
            choices = [-1] + all_slots[:active]
            token_slots = [choices[i % len(choices)] for i in range(n)]
            graph, eager, base = _probe(llm, n, token_slots, seed=bucket * 10 + active)
            scale = eager.float().abs().max()
            assert (graph.float() - eager.float()).abs().max() <= 1e-2 * scale, f"bucket {bucket}, {active} active"
            for i, s in enumerate(token_slots):
                row_diff = (graph[i].float() - base[i].float()).abs().max()
                if s >= 0:
                    assert row_diff > 1e-2 * scale, f"bucket {bucket}: adapter row {i} equals base (LoRA dropped)"
                else:
                    assert row_diff <= 1e-2 * scale


def test_timing_a_capture_again_leaves_the_graphs_as_they_were(setup):
    """time_capture (benchmarks/bench_common.py) captures every bucket into graphs it drops: the runner's
    graphs give the same bits before and after, with adapters active."""
    _, _, llm = setup
    slots = llm.engine.lora_manager.prepare({"a0", "a2"}, set())
    gr = llm.engine.runner.graph_runner
    token_slots = [slots["a0"], -1, slots["a2"], slots["a0"], -1]
    before, eager, _ = _probe(llm, 5, token_slots, seed=7)
    graphs = dict(gr.graphs)
    assert time_capture(gr) > 0
    assert gr.graphs == graphs
    after, _, _ = _probe(llm, 5, token_slots, seed=7)
    assert torch.equal(before, after)
    assert (after.float() - eager.float()).abs().max() <= 1e-2 * eager.float().abs().max()


def test_side_stream_delta_equals_in_place_lora(setup):
    """LoRA products on the side stream, added by the next kernel, give the bits of adding them in place."""
    _, _, llm = setup
    runner = llm.engine.runner
    runner_slots = llm.engine.lora_manager.prepare({"a0", "a1", "a3"}, set())
    assert runner.lora.side is not None
    dev = torch.device("cuda")
    builder0 = runner.lora.metadata
    other_builder = LoRAMetaBuilder(builder0.max_tokens, builder0.max_loras, runner.lora.pool.block_tables)
    # 9 and 5 tokens share kernel shapes (the bound side-stream launches), 100 has others; another
    # metadata buffer must not be served by launches bound to the runner's
    for n, builder in ((9, builder0), (5, builder0), (100, builder0), (5, other_builder)):
        token_slots = np.array([-1, runner_slots["a0"], runner_slots["a1"], runner_slots["a3"]] * 25)[:n]
        ids = torch.arange(3, 3 + n, device=dev)
        positions = torch.zeros(n, dtype=torch.long, device=dev)
        tables = torch.arange(n, dtype=torch.int32, device=dev).view(n, 1)
        attn = AttentionMetadata(tables.view(-1).long() * runner.block_size, tables,
                                 torch.ones(n, dtype=torch.int32, device=dev),
                                 torch.arange(n + 1, dtype=torch.int32, device=dev), 1, True)
        outs = []
        with torch.inference_mode():
            for side in (runner.lora.side.for_this_pass(), None):
                builder.build(token_slots)
                lora = LoRABatch(builder.metas, side)
                outs.append(runner.model(ids, positions, ForwardContext(attn, lora)).clone())
        assert torch.equal(outs[0], outs[1]), f"{n} tokens"


def test_factored_lora_equals_in_place_lora(setup):
    """In a prefill-sized step the factored layers (gate/up) pass their product to the next op, which expands
    it as it reads: the same numbers as adding it in place (up to the order of the product's sums)."""
    _, _, llm = setup
    runner = llm.engine.runner
    ids_of = llm.engine.lora_manager.prepare({"a0", "a1", "a3"}, set())
    factored = [m for m in runner.model.modules() if getattr(m, "factored", False)]
    assert factored, "no LoRA layer passes factors"
    dev = torch.device("cuda")
    n = 700  # more than the side stream takes: the in-place / factored path
    rng = np.random.default_rng(4)
    lengths = [100, 150, 250, 200]
    token_slots = np.concatenate([np.full(k, s) for k, s in zip(lengths, [-1, ids_of["a0"], ids_of["a1"], ids_of["a3"]])])
    ids = torch.from_numpy(rng.integers(3, llm.engine.hf_config.vocab_size, n)).to(dev)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = torch.from_numpy(np.concatenate([np.arange(k) for k in lengths])).to(dev)
    blocks_per_seq = -(-max(lengths) // runner.block_size)
    tables = torch.arange(len(lengths) * blocks_per_seq, dtype=torch.int32, device=dev).view(len(lengths), -1)
    bs = runner.block_size
    slot_mapping = torch.cat([tables[i, torch.arange(k, device=dev) // bs].long() * bs + torch.arange(k, device=dev) % bs
                              for i, k in enumerate(lengths)])
    attn = AttentionMetadata(slot_mapping, tables, torch.tensor(lengths, dtype=torch.int32, device=dev),
                             torch.from_numpy(starts).to(dev), max(lengths), False)
    outs = []
    with torch.inference_mode():
        for on in (True, False):
            for layer in factored:
                layer.factored = on
            lora = LoRABatch(runner.lora.write_metadata(token_slots), None)
            outs.append(runner.model(ids, positions, ForwardContext(attn, lora)).float())
        base = runner.model(ids, positions, ForwardContext(attn, None)).float()
    for layer in factored:
        layer.factored = True
    tol = 2e-2 * float(outs[1].abs().max())
    assert (outs[0] - outs[1]).abs().max() <= tol
    lora_rows = torch.from_numpy(token_slots >= 0).to(dev)
    assert (outs[0][lora_rows] - base[lora_rows]).abs().max() > tol, "the factored product was left out"
    assert torch.equal(outs[0][~lora_rows], outs[1][~lora_rows])


def test_lora_in_the_gemms_extra_columns_equals_in_place_lora(setup, monkeypatch):
    """In a prefill-sized step on one GPU each LoRA layer's product is summed inside its base GEMM (the op
    before it leaves columns of room after x: lora/layers.py): per layer the numbers of adding it in place up to
    rounding (the sum rounded once, z rounded to bf16 first), for q/k/v, o, gate/up and down, base rows too."""
    _, _, llm = setup
    runner = llm.engine.runner
    ids_of = llm.engine.lora_manager.prepare({"a0", "a1", "a2", "a3"}, set())
    dev = torch.device("cuda")
    lengths = [100, 150, 250, 120, 80]
    n = sum(lengths)  # more than the side stream takes
    token_slots = np.concatenate([np.full(k, s) for k, s in zip(
        lengths, [-1, ids_of["a0"], ids_of["a1"], ids_of["a2"], ids_of["a3"]])])
    lora_rows = torch.from_numpy(token_slots >= 0).to(dev)
    metas = runner.lora.write_metadata(token_slots)
    builder = runner.lora.metadata
    assert builder.step_columns == 4 + 8 + 16 + 2  # the four adapters side by side, each as wide as its rank
    in_gemm = ForwardContext(None, LoRABatch(metas, runner.lora.side, None, builder.step_columns, builder.step_adapters.size))
    in_place = ForwardContext(None, LoRABatch(metas, runner.lora.side, None))
    layer0 = runner.model.model.layers[0]
    layers = [layer0.self_attn.qkv_proj, layer0.self_attn.o_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj]
    gen = torch.Generator(device=dev).manual_seed(8)
    placed = []
    place_factors = loraserve_layers.place_factors
    monkeypatch.setattr(loraserve_layers, "place_factors", lambda *a, **k: (placed.append(1), place_factors(*a, **k)))
    with torch.inference_mode():
        for layer in layers:
            k, extra = layer.in_features, layer.input_columns(in_gemm, n)
            assert extra > 0 and layer.input_columns(in_place, n) == 0
            x = torch.randn(n, k, generator=gen, device=dev).bfloat16()
            roomy = torch.empty(n, k + extra, dtype=x.dtype, device=dev)[:, :k]  # as the op before leaves it
            roomy.copy_(x)
            got = layer(roomy, in_gemm)
            assert len(placed) == 1, "the product did not go into the GEMM"
            placed.clear()
            factored, layer.factored = layer.factored, False  # gate/up: its product added in place too
            try:
                want = layer(x, in_place)
            finally:
                layer.factored = factored
            base = layer.base(x).y
            assert got.delta is None and want.delta is None
            scale = float(want.y.float().abs().max())
            err = float((got.y.float() - want.y.float()).abs().max())
            assert err <= 1e-2 * scale, (layer.slice_names, err, scale)
            product = (want.y.float() - base.float()).abs()
            assert float(product[lora_rows].max()) > 4e-2 * scale, "the step's LoRA products are too small to tell"
            assert float((got.y.float() - base.float())[~lora_rows].abs().max()) <= 1e-2 * scale  # base rows


def test_mixed_prefill_and_decode_steps_match_peft_bf16(setup):
    """Steps that mix prompt chunks (more tokens than the side stream takes) with decode rows, adapters
    and base rows mixed: greedy tokens equal PEFT bf16's."""
    folder, paths, _ = setup
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=40, enable_lora=True,
              max_loras=4, max_lora_rank=16, max_num_batched_tokens=600)
    for name, path in paths.items():
        llm.add_lora(LoRARequest(name, path))
    assert_matches_peft_bf16(llm, folder, paths, (60, 110), seed=5)


def test_adapter_loaded_or_replaced_after_capture_takes_effect(setup, tmp_path_factory):
    folder, _, llm = setup
    manager = llm.engine.lora_manager
    new_paths = make_lora_adapters(folder, tmp_path_factory.mktemp("late"),
                                   [{"name": "late", "r": 8, "lora_alpha": 16, "target_modules": TARGETS},
                                    {"name": "late2", "r": 16, "lora_alpha": 16, "target_modules": TARGETS}],
                                   seed=9)
    llm.add_lora(LoRARequest("late", new_paths[0]))
    slot = manager.prepare({"late"}, set())["late"]
    graph, eager, base = _probe(llm, 3, [slot, -1, slot], seed=1)
    tol = 1e-2 * float(eager.float().abs().max())
    assert (graph.float() - eager.float()).abs().max() <= tol
    assert (graph[0].float() - base[0].float()).abs().max() > tol
    # replace: unload "late" (its pages are freed) and load "late2", which takes pages; the next replay follows
    llm.remove_lora("late")
    llm.add_lora(LoRARequest("late2", new_paths[1]))
    slot2 = manager.prepare({"late2"}, set())["late2"]
    graph2, eager2, _ = _probe(llm, 3, [slot2, -1, slot2], seed=1)
    assert (graph2.float() - eager2.float()).abs().max() <= 1e-2 * float(eager2.float().abs().max())
    assert (graph2[0].float() - graph[0].float()).abs().max() > tol, "the replaced adapter's weights were not used"


def assert_matches_peft_bf16(llm, folder, paths, prompt_lengths, seed):
    """35 prompts (base and the four adapters in turn) through llm: greedy tokens equal PEFT's for 16 tokens on
    at least 90% of them: PEFT's in bf16, or, where its bf16 rounding moves its own choice, PEFT's in fp32."""
    adapters = {name: paths[name] for name in ["a0", "a1", "a2", "a3"]}
    refs = [load_peft_model(folder, adapters, dtype, "cuda") for dtype in (torch.bfloat16, torch.float32)]
    rng = random.Random(seed)
    names = [None, "a0", "a1", "a2", "a3"] * 7
    vocab = refs[0].config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lengths))] for _ in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        lora_request=[LoRARequest(n) if n else None for n in names])
    matches = []
    for name, prompt, out in zip(names, prompts, outs):
        tokens = out.outputs[0].token_ids
        matches.append([is_greedy_of(tokens, teacher_forced_logprobs(peft, prompt, tokens,
                                                                     adapter_names=[name or "__base__"]))
                        for peft in refs])
    agree = sum(any(m) for m in matches)
    assert agree / len(names) >= 0.9, (f"{agree}/{len(names)} rows match PEFT (bf16: {sum(m[0] for m in matches)}, "
                                       f"fp32: {sum(m[1] for m in matches)})")


def test_graphs_with_lora_match_peft_bf16(setup):
    folder, paths, llm = setup
    assert_matches_peft_bf16(llm, folder, paths, (1, 30), seed=2)


def test_graphs_follow_adapters_moving_through_a_full_pool(setup):
    """Graph replay equals eager for every bucket while adapters are evicted and loaded between replays:
    a pool of 6 pages of every page block (max_lora_rank 16: 2 each) and 12 adapters of ranks 8 and 16 taking
    turns, so pages are reused by other adapters and ids change."""
    folder, _, first = setup
    pool = first.engine.lora_manager.pool  # the same model, dtype and layers: the same pages and blocks
    room = 6 * pool.layout.num_blocks
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=40, enable_lora=True,
              max_loras=3, max_lora_rank=16, lora_gpu_memory=(room + 0.5) * pool.page_bytes / 2**30)
    manager = llm.engine.lora_manager
    assert manager.pool.num_pages == room
    for i in range(12):
        manager.register_adapter(f"m{i}", random_adapter(manager.runtime.spec, f"m{i}", [8, 16][i % 2], seed=40 + i,
                                                         std=0.05))
    gr = llm.engine.runner.graph_runner
    rng = random.Random(3)
    for round_ in range(6):
        names = rng.sample([f"m{i}" for i in range(12)], 3)
        if sum(manager.pages_of(n) for n in names) > room:
            names = names[:2]
        ids = manager.prepare(set(names), set())
        for bucket in gr.buckets:
            n = max(1, bucket - 1) if bucket > 1 else 1
            choices = [-1] + [ids[name] for name in names]
            token_ids = [choices[i % len(choices)] for i in range(n)]
            graph, eager, base = _probe(llm, n, token_ids, seed=100 * round_ + bucket)
            scale = eager.float().abs().max()
            assert (graph.float() - eager.float()).abs().max() <= 1e-2 * scale, f"round {round_}, bucket {bucket}"
            assert all((graph[i].float() - base[i].float()).abs().max() > 1e-2 * scale
                       for i, s in enumerate(token_ids) if s >= 0), "an adapter row equals base"
    assert manager.num_gpu_evictions > 0


def test_prefill_graphs_follow_adapters_moving_through_a_full_pool(setup):
    """The graphs of steps that prefill (a few decode rows and a prompt chunk, worker/mixed_graphs.py): every
    bucket's replay equals the eager forward of the same step while adapters are evicted and loaded between
    replays, and the rows of adapters differ from the same step on the base model (LoRA was not left out)."""
    folder, _, first = setup
    pool = first.engine.lora_manager.pool
    room = 6 * pool.layout.num_blocks  # 6 pages of every page block
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=40, enable_lora=True,
              max_loras=3, max_lora_rank=16, lora_gpu_memory=(room + 0.5) * pool.page_bytes / 2**30,
              max_num_batched_tokens=512)
    runner, manager = llm.engine.runner, llm.engine.lora_manager
    graphs = runner.mixed_graphs
    assert graphs.buckets == [32, 64, 96, 128, 192, 256, 384, 512] and set(graphs.graphs) == set(graphs.buckets)
    for i in range(8):
        manager.register_adapter(f"p{i}", random_adapter(manager.runtime.spec, f"p{i}", [8, 16][i % 2], seed=60 + i,
                                                         std=0.05))
    rng = random.Random(4)
    for round_ in range(4):
        names = rng.sample([f"p{i}" for i in range(8)], 3)
        if sum(manager.pages_of(n) for n in names) > room:
            names = names[:2]
        ids = sorted(manager.prepare(set(names), set()).values())
        for bucket in graphs.buckets:
            probe = probe_prefill_step(np.random.default_rng(10 * round_ + bucket), bucket, runner.block_size, ids,
                                       llm.engine.hf_config.vocab_size, 512)
            rows = np.arange(probe.num_tokens)
            graph = graphs.replay(probe).clone()
            padded = probe.padded_prefill(bucket, runner.dummy_block, runner.block_size)  # the graphs' shapes
            eager = runner.forward_eager(padded, rows=rows)
            base = runner.forward_eager(dataclasses.replace(padded, token_adapters=np.full_like(padded.token_adapters, -1)),
                                        rows=rows)
            scale = eager.float().abs().max()
            assert (graph.float() - eager.float()).abs().max() <= 1e-2 * scale, f"round {round_}, bucket {bucket}"
            lora_rows = torch.from_numpy(probe.token_adapters >= 0).cuda()
            assert lora_rows.any()
            assert ((graph[lora_rows].float() - base[lora_rows].float()).abs().amax(dim=1) > 1e-2 * scale).all(), \
                f"an adapter row equals base (round {round_}, bucket {bucket})"
    assert manager.num_gpu_evictions > 0
