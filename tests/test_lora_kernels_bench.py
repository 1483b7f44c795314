"""benchmarks/lora_kernels.py --prefill-steps on the CPU (Triton's interpreter, small layers, a stand-in for the
CUDA-graph timer): every layer, pool width and step gets its row, each timed launch runs, and the steps hold the
prompts and decode rows STEP_MIXES names."""
import sys
from pathlib import Path

import numpy as np
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import lora_kernels  # noqa: E402 (the benchmark under test)


def test_prefill_steps_time_every_layer_width_and_step(monkeypatch):
    mixes = {"3 x 40": (3, 40, 0, 0), "3 x 40 + 7 rows": (3, 40, 7, 4), "2 x 30 + 5 rows": (2, 30, 5, 0)}
    monkeypatch.setattr(lora_kernels, "DEV", "cpu")
    monkeypatch.setattr(lora_kernels, "DTYPE", torch.float32)
    monkeypatch.setattr(lora_kernels, "LAYERS", {"qkv": (64, (64, 16, 16)), "gate_up": (64, (96, 96)),
                                                 "down": (96, (64,))})
    monkeypatch.setattr(lora_kernels, "STEP_MIXES", mixes)
    monkeypatch.setattr(lora_kernels, "STEP_POOL", 16)
    # one of the shrink's variants keeps the interpreter's time down (test_step_shrink_variants_equal_the_reference
    # runs each)
    monkeypatch.setattr(lora_kernels, "STEP_SHRINK_VARIANTS", lora_kernels.STEP_SHRINK_VARIANTS[:1])
    launches = []

    def run_once(ops, reps=20):  # the graph timer's stand-in: each op once, a fixed time
        for op in ops:
            launches.append(op())
        return 2.0

    monkeypatch.setattr(lora_kernels, "graph_us", run_once)
    rows = lora_kernels.prefill_steps(reps=1, ops=2)
    widths = lora_kernels.STEP_RANK_WIDTHS
    assert [(r["layer"], r["rank_width"], r["step"]) for r in rows] == [
        (layer, width, mix) for layer in ("qkv", "gate_up", "down") for width in widths for mix in mixes]
    for row in rows:
        prompts, length, decode, others = mixes[row["step"]]
        assert row["T"] == prompts * length + decode
        assert row["adapters"] == prompts + others
        variants = {f"expand_us ({label})" for label, _ in lora_kernels.STEP_EXPAND_VARIANTS}
        # gate/up: the factors told the step's largest rank, and in a wider pool also told only its width
        wider = row["rank_width"] > lora_kernels.GRID_RANK
        silu = {"silu_and_mul_us", "silu_and_mul_lora_us"} | ({"silu_and_mul_lora_us (pool width)"} if wider else set())
        shrinks = {"shrink_us"} | {f"shrink_us ({label})" for label, _ in lora_kernels.STEP_SHRINK_VARIANTS}
        timed = shrinks | silu if row["layer"] == "gate_up" else shrinks | {"expand_us"} | variants
        assert {k for k in row if k.endswith("us") or k.endswith(")")} == timed
    shrinks = 1 + len(lora_kernels.STEP_SHRINK_VARIANTS)
    expands = shrinks + 1 + len(lora_kernels.STEP_EXPAND_VARIANTS)
    per_row = {"qkv": lambda r: expands, "down": lambda r: expands,
               "gate_up": lambda r: shrinks + 2 + (r["rank_width"] > lora_kernels.GRID_RANK)}
    assert len(launches) == 2 * sum(per_row[r["layer"]](r) for r in rows)


def test_step_adapters_give_each_prompt_its_adapter():
    rng = np.random.default_rng(0)
    for mix, (prompts, length, decode, others) in lora_kernels.STEP_MIXES.items():
        ids = lora_kernels.step_adapters(mix, rng)
        prompt_ids = ids[:prompts * length].reshape(prompts, length)
        assert (prompt_ids == prompt_ids[:, :1]).all() and len(set(prompt_ids[:, 0].tolist())) == prompts, mix
        rows = set(ids[prompts * length:].tolist())
        assert len(rows) == others if others else rows <= set(prompt_ids[:, 0].tolist()), mix


def test_step_shrink_variants_equal_the_reference():
    """The shrink shapes --prefill-steps times beside the engine's compute what the engine's do: in the
    unsplit prefill shapes (from 2,048 tokens on), tokens without an adapter and of rank-8 and rank-0
    adapters among them (Triton's interpreter, fp32)."""
    import dataclasses
    from loraserve.kernels.lora_meta import PAGE_RANK
    from loraserve.kernels.lora_reference import lora_shrink_ref
    from loraserve.kernels.lora_shrink import lora_shrink, shrink_config
    from loraserve.lora.metadata import LoRAMetaBuilder
    gen = torch.Generator().manual_seed(3)
    num_tokens, hidden, slices, rank, adapters = 4200, 64, 3, 16, 5
    per = rank // PAGE_RANK
    lora_a = torch.randn(adapters * per, slices * PAGE_RANK, hidden, generator=gen)
    table = torch.randperm(adapters * per, generator=gen).to(torch.int32).view(adapters, per)
    ranks = torch.tensor([16, 8, 16, 0, 16], dtype=torch.int32)
    meta = LoRAMetaBuilder(num_tokens, adapters, table).build(torch.randint(-1, adapters, (num_tokens,), generator=gen))
    x = torch.randn(num_tokens, hidden, generator=gen)
    ref = lora_shrink_ref(x, lora_a, ranks, meta, slices)
    assert ref.norm() > 0
    for label, change in lora_kernels.STEP_SHRINK_VARIANTS:
        config = dataclasses.replace(shrink_config(num_tokens, hidden, slices * rank), **change)
        out = torch.zeros(num_tokens, slices * rank)
        lora_shrink(x, lora_a, ranks, meta, slices, out, config)
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), label
