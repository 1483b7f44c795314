"""Tensor parallelism on the CPU: 2 and 4 ranks (gloo) against one rank and against HF + PEFT, in fp32.

The tiny model has 4 query heads and 2 KV heads (2 ranks split the KV heads, 4 ranks keep each on two
ranks) and a vocabulary of 1001 (no rank count divides it: the last rank's rows are padding). Each engine
is built once per rank count and serves every test of the module (starting worker processes costs seconds).
"""
from __future__ import annotations

import dataclasses
import random
import threading
import types
from datetime import timedelta
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_reference import assert_matches_reference, load_peft_model, teacher_forced_logprobs
from model_fixtures import CONFIDENT_STEPS, WINDOW, make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.distributed import ParallelGroup
from loraserve.models.loader import build_empty_model, open_model
from loraserve.models.linear import (FP32_REDUCE_MAX_TOKENS, PackedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from loraserve.peer_all_reduce import GroupExchangeStore

VOCAB = 1001
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_SPECS = [  # every module kind, ranks 4, 8 and 16
    {"name": "r4_all", "r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES},
    {"name": "r8_rows", "r": 8, "lora_alpha": 32, "use_rslora": True, "target_modules": ["q_proj", "o_proj", "down_proj"]},
    {"name": "r16_cols", "r": 16, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj", "gate_proj", "up_proj"]},
]
ENGINE = dict(device="cpu", max_model_len=256, max_num_batched_tokens=48, enable_lora=True, max_loras=4,
              max_lora_rank=16)  # a step budget below the longest prompt: prompts are prefilled in chunks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=8, prompt_logprobs=3)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, logprobs=3)
ROWS = [None, "r4_all", "r8_rows", "r16_cols", None, "r4_all", "r16_cols", "r8_rows"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory("llama", vocab_size=VOCAB)
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("tp-adapters"), ADAPTER_SPECS, seed=3)
    adapters = dict(zip([s["name"] for s in ADAPTER_SPECS], paths))
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 70))] for _ in ROWS]
    requests = [LoRARequest(name, adapters[name]) if name else None for name in ROWS]
    single = LLM(folder, **ENGINE)
    reference = _generate(single, prompts, requests)
    return folder, adapters, prompts, requests, reference


def _generate(llm, prompts, requests):
    """Greedy rows (with logprobs and prompt logprobs), then the same prompts sampled with a seed."""
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests, use_tqdm=False)
    seeded = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], SEEDED, lora_request=requests[:3],
                          use_tqdm=False)
    return greedy, seeded


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def parallel(request, setup):
    folder, *_ = setup
    llm = LLM(folder, tensor_parallel_size=request.param, **ENGINE)
    yield llm
    llm.engine.shutdown()
    assert not any(p.is_alive() for p in llm.engine.workers._procs)


def _assert_close(got: dict[int, float], want: dict[int, float], where: str) -> None:
    assert set(got) == set(want), where
    for token, lp in want.items():
        assert abs(got[token] - lp) <= ATOL, f"{where}, token {token}: {got[token]} vs {lp}"


def test_outputs_equal_one_rank_with_mixed_adapters(parallel, setup):
    """Greedy tokens identical to one rank's, every logprob (generated and prompt) within 1e-4, base rows
    and rows of three adapters (every module kind, ranks 4/8/16) mixed in one batch; seeded sampling too."""
    _, _, prompts, requests, (ref_greedy, ref_seeded) = setup
    greedy, seeded = _generate(parallel, prompts, requests)
    for i, (out, ref) in enumerate(zip(greedy, ref_greedy)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"row {i} ({ROWS[i]})"
        for pos, (got, want) in enumerate(zip(out.outputs[0].logprobs, ref.outputs[0].logprobs)):
            _assert_close(got, want, f"row {i} position {pos}")
        for pos, (got, want) in enumerate(zip(out.prompt_logprobs, ref.prompt_logprobs)):
            if want is not None:
                _assert_close(got, want, f"row {i} prompt position {pos}")
    for out, ref in zip(seeded, ref_seeded):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_mixed_adapters_match_peft(parallel, setup):
    """The same batch against HF + PEFT (an independent reference): tokens are PEFT's argmax, logprobs within
    1e-4; and each adapter changes the output."""
    folder, adapters, prompts, requests, _ = setup
    outputs = parallel.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests,
                                use_tqdm=False)
    peft = load_peft_model(folder, adapters)
    for name, prompt, out in zip(ROWS, prompts, outputs):
        ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids, adapter_names=[name or "__base__"])
        assert_matches_reference(out, ref)
    base = parallel.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    for name in adapters:
        other = parallel.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora_request=LoRARequest(name),
                                  use_tqdm=False)[0]
        assert other.outputs[0].logprobs[0] != base.outputs[0].logprobs[0], name


def test_prefix_cache_hits_reuse_every_ranks_blocks(parallel, setup):
    """A prompt served before reuses its cached KV blocks (each rank holds its heads of them): the output is
    still one rank's."""
    _, _, prompts, requests, (ref_greedy, _) = setup
    longest = max((i for i, name in enumerate(ROWS) if name is None), key=lambda i: len(prompts[i]))
    stats = parallel.engine.stats
    hits = stats().prefix_cache_hits
    no_prompt_logprobs = dataclasses.replace(GREEDY, prompt_logprobs=None)  # (those compute the whole prompt)
    again = parallel.generate([{"prompt_token_ids": prompts[longest]}], no_prompt_logprobs,
                              lora_request=requests[longest], use_tqdm=False)[0]
    assert stats().prefix_cache_hits > hits
    assert again.outputs[0].token_ids == ref_greedy[longest].outputs[0].token_ids
    for got, want in zip(again.outputs[0].logprobs, ref_greedy[longest].outputs[0].logprobs):
        _assert_close(got, want, "after a prefix-cache hit")


def test_adapters_loaded_after_eviction_reach_every_rank(setup):
    """A pool with room for one adapter of max rank: requests one after another swap adapters in and out; the
    ranks follow rank 0's loads (same ids and pages, each its own part) and the outputs stay one rank's."""
    folder, adapters, prompts, _, _ = setup
    options = dict(ENGINE, max_loras=1)  # the CPU's default pool: max_loras adapters of max_lora_rank
    single, parallel = LLM(folder, **options), LLM(folder, tensor_parallel_size=2, **options)
    try:
        order = ["r4_all", "r16_cols", "r8_rows", "r4_all", "r16_cols"]
        for name, prompt in zip(order, prompts):
            request = LoRARequest(name, adapters[name])
            got = parallel.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=request, use_tqdm=False)[0]
            want = single.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=request, use_tqdm=False)[0]
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
            for g, w in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
                _assert_close(g, w, name)
        assert parallel.engine.stats().lora_gpu_evictions >= 2
    finally:
        parallel.engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_other_architectures_on_two_ranks_equal_one(arch, tiny_model_factory, tmp_path_factory):
    """Qwen3 (q/k norms), Gemma 2 and 3 (their norms, embedding scale, soft-caps, sliding windows) and Phi-3 (q/k/v
    and gate/up packed in the checkpoint and in its adapters) on 2 ranks: an adapter on every module the
    architecture offers mixed with base rows, prompts longer than the window: one rank's tokens and logprobs."""
    folder = tiny_model_factory(arch)
    targets = list(type(build_empty_model(open_model(folder).hf_config, torch.device("cpu"),
                                          torch.float32)).peft_target_modules())
    (path,) = make_lora_adapters(folder, tmp_path_factory.mktemp(f"tp-{arch}"),
                                 [{"name": "r8", "r": 8, "lora_alpha": 16, "target_modules": targets}], seed=2)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randint(WINDOW + 1, 40))]}
               for _ in range(4)]
    requests = [None, LoRARequest("r8", path), None, LoRARequest("r8", path)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    options = dict(device="cpu", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    want = LLM(folder, **options).generate(prompts, params, lora_request=requests, use_tqdm=False)
    parallel = LLM(folder, tensor_parallel_size=2, **options)
    try:
        got = parallel.generate(prompts, params, lora_request=requests, use_tqdm=False)
    finally:
        parallel.engine.shutdown()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"{arch} row {i}"
        for pos, (gl, wl) in enumerate(zip(g.outputs[0].logprobs, w.outputs[0].logprobs)):
            _assert_close(gl, wl, f"{arch} row {i} position {pos}")


def test_bf16_ranks_greedy_equal_one_rank(tiny_model_factory, tmp_path_factory):
    """bf16 on 2 and 4 ranks: greedy tokens equal one rank's for 16 tokens on >= 90 % of 24 rows, base rows and
    rows of three adapters mixed. (Row-parallel partial outputs rounded to bf16 before their sum gave 20-25 of 32
    equal rows at these sizes; summed in fp32 and rounded once, every row.)"""
    folder = tiny_model_factory("llama", vocab_size=VOCAB, train_steps=CONFIDENT_STEPS)
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("tp-bf16-adapters"), ADAPTER_SPECS, seed=5)
    names = [None, *(s["name"] for s in ADAPTER_SPECS)]
    requests = [LoRARequest(names[i % 4], paths[i % 4 - 1]) if i % 4 else None for i in range(24)]
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 60))]} for _ in range(24)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    options = dict(ENGINE, dtype="bfloat16", max_num_batched_tokens=256)
    want = LLM(folder, **options).generate(prompts, params, lora_request=requests, use_tqdm=False)
    for size in (2, 4):
        parallel = LLM(folder, tensor_parallel_size=size, **options)
        try:
            got = parallel.generate(prompts, params, lora_request=requests, use_tqdm=False)
        finally:
            parallel.engine.shutdown()
        same = sum(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
        assert same >= 0.9 * len(want), f"{size} ranks: {same} of {len(want)} rows equal one rank's"


# -- the sharding rules, without processes ------------------------------------------------------------
def _groups(size: int) -> list[ParallelGroup]:
    return [ParallelGroup(rank, size, torch.device("cpu"), backend=object()) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 4])
def test_layer_parts_add_up_to_the_whole_layer(size):
    """Column parts stacked, row parts summed, q/k/v by heads (4 ranks: each KV head on two ranks, the one
    its query heads use), LoRA factors split as the weights: each rank's part reproduces the whole layer."""
    gen = torch.Generator().manual_seed(0)
    hidden, head_dim, heads, kv_heads, inter, r = 16, 4, 4, 2, 24, 3
    x = torch.randn(5, hidden, generator=gen)
    q, k, v = (torch.randn(n * head_dim, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    gate_a, gate_b = torch.randn(r, hidden, generator=gen), torch.randn(inter, r, generator=gen)
    down_w = torch.randn(hidden, inter, generator=gen)
    down_a, down_b = torch.randn(r, inter, generator=gen), torch.randn(hidden, r, generator=gen)
    h = torch.randn(5, inter, generator=gen)
    row_sum, row_lora = torch.zeros(5, hidden), torch.zeros(5, r)
    for tp in _groups(size):
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp=tp)
        for shard, w in enumerate((q, k, v)):
            qkv.weight_loader(qkv.weight, w, shard)
        y = qkv(x).y  # [5, (H/tp + 2 KVl) * hd]
        q_part, k_part, v_part = y.split(qkv.output_sizes, dim=-1)
        heads_here = range(tp.rank * heads // size, (tp.rank + 1) * heads // size)
        assert torch.allclose(q_part, (x @ q.T).view(5, heads, head_dim)[:, heads_here].reshape(5, -1))
        for part, w in ((k_part, k), (v_part, v)):  # the KV head of this rank's query heads (GQA groups of 2)
            kv_here = sorted({h * kv_heads // heads for h in heads_here})
            assert torch.allclose(part, (x @ w.T).view(5, kv_heads, head_dim)[:, kv_here].reshape(5, -1))
        gate_up = PackedColumnParallelLinear(hidden, [inter, inter], tp=tp)
        a, b = gate_up.lora_shard(gate_a, gate_b, 0, tp.rank)
        cols = slice(tp.rank * inter // size, (tp.rank + 1) * inter // size)
        assert torch.equal(a, gate_a) and torch.equal(b, gate_b[cols])
        down = RowParallelLinear(inter, hidden, tp=tp)
        down.weight_loader(down.weight, down_w)
        a, b = down.lora_shard(down_a, down_b, 0, tp.rank)
        assert torch.equal(b, down_b)
        row_sum += torch.nn.functional.linear(h[:, cols], down.weight)
        row_lora += h[:, cols] @ a.T  # the shrink's partial sum, all-reduced before the expand
    assert torch.allclose(row_sum, h @ down_w.T, atol=1e-5)
    assert torch.allclose(row_lora @ down_b.T, h @ down_a.T @ down_b.T, atol=1e-5)


def test_heads_that_cannot_be_split_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads 6 is not divisible by tensor_parallel_size 4"):
        QKVParallelLinear(24, 4, 6, 2, tp=_groups(4)[0])
    with pytest.raises(ValueError, match="num_key_value_heads 3 and tensor_parallel_size 2"):
        QKVParallelLinear(24, 4, 6, 3, tp=_groups(2)[0])


class _SummingBackend:
    """All-reduce between threads of one process (one per rank): what each rank passed, and the sum."""

    def __init__(self, size: int):
        self.barrier, self.parts = threading.Barrier(size), {}

    def allreduce(self, tensors, opts):
        (x,) = tensors
        self.parts[threading.get_ident()] = x.clone()
        self.barrier.wait()
        x.copy_(sum(self.parts.values()))
        self.barrier.wait()
        return types.SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize("tokens", [FP32_REDUCE_MAX_TOKENS, FP32_REDUCE_MAX_TOKENS + 1])
def test_row_parallel_bf16_partials_are_summed_in_fp32_in_small_steps(tokens):
    """A bf16 row-parallel layer sums its ranks' unrounded fp32 partial products in steps of up to
    FP32_REDUCE_MAX_TOKENS tokens and leaves the sum unrounded for the next norm (rounded, it is the whole
    product rounded once to bf16), and sums bf16 partials in larger steps."""
    gen = torch.Generator().manual_seed(0)
    size, inner, out = 2, 64, 32
    x = torch.randn(tokens, inner, generator=gen).bfloat16()
    w = torch.randn(out, inner, generator=gen).bfloat16()
    backend = _SummingBackend(size)
    layers = []
    for rank in range(size):
        layer = RowParallelLinear(inner, out, tp=ParallelGroup(rank, size, torch.device("cpu"), backend=backend))
        layer.weight_loader(layer.weight, w)
        layers.append(layer.to(torch.bfloat16))
    cols = inner // size
    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(lambda r: layers[r](x[:, r * cols:(r + 1) * cols]), range(size)))
    small = tokens <= FP32_REDUCE_MAX_TOKENS
    assert all(p.dtype == (torch.float32 if small else torch.bfloat16) for p in backend.parts.values())
    whole = (x.float() @ w.float().T)  # [T, out] exact enough in fp32
    for out in results:
        assert out.y.dtype == (torch.float32 if small else torch.bfloat16)
        y = out.rounded(torch.bfloat16)
        assert y.dtype == torch.bfloat16
        if small:
            assert torch.allclose(y.float(), whole.bfloat16().float(), rtol=0, atol=1e-3 * whole.abs().max())
            assert (y.float() == whole.bfloat16().float()).float().mean() > 0.99


def test_exchange_keys_agree_between_a_long_lived_rank_and_fresh_ones():
    """Symmetric memory numbers its store exchanges with one counter per process: rank 0 of a second engine
    has counted the first engine's exchanges, its fresh workers have not. Through GroupExchangeStore both
    number this group's exchanges from 0, so each gathers the other's values (raw keys would wait forever)."""
    shared = torch.distributed.HashStore()
    counters = {0: 7, 1: 0}  # the process-wide counter of each rank when this group's first exchange starts

    def rank(r: int) -> list[bytes]:
        store = GroupExchangeStore(torch.distributed.PrefixStore("group", shared))
        gathered = []
        for _ in range(3):  # torch's all_gather: set its own key, wait for and read every other rank's
            n = counters[r]
            counters[r] += 1
            store.set(f"CUDASymmetricMemory/{n}/{r}", f"{r}:{n}".encode())
            peer = f"CUDASymmetricMemory/{n}/{1 - r}"
            store.wait([peer], timedelta(seconds=10))
            gathered.append(store.get(peer))
        store.set("untouched/key", b"x")
        return gathered

    with ThreadPoolExecutor(2) as pool:
        got0, got1 = pool.map(rank, [0, 1])
    assert got0 == [b"1:0", b"1:1", b"1:2"] and got1 == [b"0:7", b"0:8", b"0:9"]
    assert shared.get("group/untouched/key") == b"x"
