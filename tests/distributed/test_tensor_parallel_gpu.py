"""Tensor parallelism on 2 GPUs (NCCL): against one GPU in fp32 and bf16 (bf16 on 4 GPUs too, where there are
four), CUDA graphs (with their all-reduces and the LoRA kernels inside) against eager in every bucket, a
killed worker and a script's own exit status (marked gpu and multigpu).

Engines share GPU 0 with each other, so each takes a small KV cache (max_num_seqs sequences of
max_model_len) and a fixed adapter pool.
"""
from __future__ import annotations

import random

import pytest
import torch

from model_fixtures import CONFIDENT_STEPS, make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from tp_driver import run_exit, run_killed_worker

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 8 adapters: every module kind, ranks 4 to 64
EIGHT = [{"name": f"a{i}", "r": r, "lora_alpha": 2 * r, "target_modules": targets}
         for i, (r, targets) in enumerate([(4, ALL_MODULES), (8, ["q_proj", "o_proj", "down_proj"]),
                                           (16, ["k_proj", "v_proj", "gate_proj", "up_proj"]), (32, ALL_MODULES),
                                           (64, ["o_proj", "down_proj"]), (8, ALL_MODULES),
                                           (16, ["q_proj", "v_proj"]), (4, ["gate_proj", "up_proj", "down_proj"])])]
ENGINE = dict(device="cuda", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, enable_lora=True,
              max_loras=8, max_lora_rank=64, lora_gpu_memory=0.05)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def _rows(n: int, adapters: dict[str, str]) -> list[LoRARequest | None]:
    """Base rows and the 8 adapters in turn."""
    names = [None, *adapters]
    return [LoRARequest(names[i % len(names)], adapters[names[i % len(names)]]) if i % len(names) else None
            for i in range(n)]


@pytest.fixture(scope="module")
def bf16_model(tiny_model_factory, tmp_path_factory):
    """A confident tiny model, its 8 adapters and its engine on one GPU, in bf16."""
    folder = tiny_model_factory("llama", train_steps=CONFIDENT_STEPS)
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("tp-gpu-adapters"), EIGHT, seed=5)
    adapters = dict(zip([s["name"] for s in EIGHT], paths))
    return folder, adapters, LLM(folder, dtype="bfloat16", **ENGINE)


@pytest.fixture(scope="module", params=[2, 4])
def bf16(request, bf16_model):
    """bf16_model and an engine of `param` GPUs (graphs) on the same model."""
    if torch.cuda.device_count() < request.param:
        pytest.skip(f"needs {request.param} CUDA devices")
    folder, adapters, one = bf16_model
    several = LLM(folder, dtype="bfloat16", tensor_parallel_size=request.param, **ENGINE)
    yield folder, adapters, one, several
    several.engine.shutdown()


def test_bf16_several_gpus_greedy_equals_one_gpu(bf16):
    """2 and 4 GPUs: 16 greedy tokens equal to one GPU's on >= 90 % of 32 prompts, without adapters and with
    the 8 adapters mixed in one batch."""
    folder, adapters, one, several = bf16
    vocab = one.engine.hf_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in _prompts(32, vocab, seed=1)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for requests in (None, _rows(32, adapters)):
        a = one.generate(prompts, params, lora_request=requests, use_tqdm=False)
        b = several.generate(prompts, params, lora_request=requests, use_tqdm=False)
        same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b)) / len(prompts)
        assert same >= 0.9, f"{'with' if requests else 'without'} adapters: {same:.0%} of rows equal"


def test_graphs_with_collectives_equal_eager_in_every_bucket(bf16):
    """Every bucket was captured and passed the start-up check on every rank; a batch of each bucket's size,
    adapters mixed, gives eager's tokens and logprobs (within bf16 rounding)."""
    folder, adapters, _, several = bf16
    graphs = several.engine.runner.graph_runner
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets
    eager = LLM(folder, dtype="bfloat16", tensor_parallel_size=several.engine.config.parallel.tensor_parallel_size,
                enforce_eager=True, **ENGINE)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
        vocab = several.engine.hf_config.vocab_size
        for batch in graphs.buckets:
            prompts = [{"prompt_token_ids": p} for p in _prompts(batch, vocab, seed=100 + batch)]
            requests = _rows(batch, adapters)
            g = several.generate(prompts, params, lora_request=requests, use_tqdm=False)
            e = eager.generate(prompts, params, lora_request=requests, use_tqdm=False)
            for go, eo in zip(g, e):
                assert go.outputs[0].token_ids == eo.outputs[0].token_ids, f"bucket {batch}"
                for gl, el in zip(go.outputs[0].logprobs, eo.outputs[0].logprobs):
                    for tid in el:
                        assert abs(gl[tid] - el[tid]) <= 1e-2 * max(1.0, abs(el[tid])), f"bucket {batch}"
    finally:
        eager.engine.shutdown()


def test_fp32_two_gpus_match_one_gpu(tiny_model_factory, tmp_path_factory):
    """fp32 (vocab 1001: the last rank's vocabulary rows are padding), mixed adapters of every module kind:
    greedy tokens equal to one GPU's, logprobs within 1e-4."""
    folder = tiny_model_factory("llama", vocab_size=1001)
    specs = EIGHT[:4]
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("tp-gpu-fp32"), specs, seed=6)
    adapters = dict(zip([s["name"] for s in specs], paths))
    prompts = [{"prompt_token_ids": p} for p in _prompts(10, 1001, seed=2)]
    requests = _rows(10, adapters)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    want = LLM(folder, dtype="float32", **ENGINE).generate(prompts, params, lora_request=requests, use_tqdm=False)
    two = LLM(folder, dtype="float32", tensor_parallel_size=2, **ENGINE)
    try:
        got = two.generate(prompts, params, lora_request=requests, use_tqdm=False)
    finally:
        two.engine.shutdown()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"row {i}"
        for pos, (gl, wl) in enumerate(zip(g.outputs[0].logprobs, w.outputs[0].logprobs)):
            assert set(gl) == set(wl)
            for tid, lp in wl.items():
                assert abs(gl[tid] - lp) <= 1e-4, f"row {i} position {pos} token {tid}: {gl[tid]} vs {lp}"


def test_killed_worker_on_gpus_stops_the_engine(tiny_model_factory):
    """SIGKILL to the worker of GPU 1 mid-generation: a WorkerDiedError naming it, no hang (the collectives
    rank 0 waits in are aborted), no process left."""
    run_killed_worker(tiny_model_factory("llama"), "cuda")


def test_script_on_gpus_exits_with_its_own_status(tiny_model_factory):
    """A script on two GPUs that leaves its engine (CUDA graphs holding NCCL collectives) to the interpreter's
    exit ends with its own status at once: its graphs are released before its group is left."""
    run_exit(tiny_model_factory("llama"), "cuda")
