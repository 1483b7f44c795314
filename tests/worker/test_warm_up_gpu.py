"""GPU (marked gpu): once the engine has started, no Triton kernel compiles while requests run. Prefill steps of
odd and even token counts in every range of one kernel shape (the mixed graphs' sizes, the eager LoRA path past
the side stream's scratch, the prefill shapes), with rank-8 adapters (whose shrink widths, 8 and 24, make the
counts' parity matter to Triton's specialization) and base rows, and steps mixing decode rows with a prompt chunk
for several counts of decode rows: Triton's compile hook sees none of them."""
import numpy as np
import pytest

from loraserve import LoRARequest, SamplingParams
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.lora.synthetic import random_adapter

pytestmark = pytest.mark.gpu

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
BUDGET = 1024  # the step's token budget: warm-up passes at 32..514 and 1,024 tokens


def compile_hook_knobs():
    """Triton's runtime knobs with the hook called after each compile, or a skip."""
    triton = pytest.importorskip("triton")
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None or not hasattr(knobs, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook (triton.knobs.runtime.jit_post_compile_hook)")
    return knobs


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_no_kernel_compiles_while_requests_run(monkeypatch):
    knobs = compile_hook_knobs()
    engine = LLMEngine.from_args(EngineArgs(
        "synthetic:tiny", device="cuda", dtype="bfloat16", max_model_len=BUDGET + 64, max_num_seqs=64,
        max_num_batched_tokens=BUDGET, enable_lora=True, max_loras=8, max_lora_rank=8))
    spec = engine.lora_manager.runtime.spec
    for i, targets in enumerate((QKVO, None)):
        engine.lora_manager.register_adapter(f"a{i}", random_adapter(spec, f"a{i}", 8, targets, seed=i))
    names = ["a0", "a1", None]
    compiled: list[str] = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        compiled.append(f"{getattr(fn, 'name', None)}: {str(kwargs.get('repr'))[:300]}")

    monkeypatch.setattr(knobs, "jit_post_compile_hook", hook)
    rng = np.random.default_rng(0)
    vocab = engine.hf_config.vocab_size
    short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    n = 0
    for length in (1, 7, 33, 300, 301, 513, 514, 547, 777, 1000, 1023):  # prefill steps of these counts
        for name in names:
            engine.add_request(f"p{n}", rng.integers(0, vocab, length).tolist(), short,
                               LoRARequest(name) if name else None)
            n += 1
            run_to_end(engine)
    long = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    for rows in (1, 2, 3, 5, 6, 7, 12):  # decode rows beside a 600-token chunk: eager mixed steps
        for i in range(rows):
            engine.add_request(f"d{n}-{i}", rng.integers(0, vocab, 20).tolist(), long,
                               LoRARequest(names[i % 3]) if names[i % 3] else None)
        for _ in range(3):
            engine.step()
        engine.add_request(f"c{n}", rng.integers(0, vocab, 600).tolist(), short, LoRARequest(names[rows % 3])
                           if names[rows % 3] else None)
        n += 1
        run_to_end(engine)
    assert compiled == [], f"kernels compiled after start-up: {compiled}"


def test_no_kernel_compiles_when_a_steps_adapters_need_more_room_than_the_gemms_have(monkeypatch):
    """Four rank-64 adapters in one step of more than 512 tokens: q/k/v needs 768 columns for their products,
    more than the 512 its GEMM has, so q/k/v adds its product in place while the other layers sum theirs
    inside their GEMMs. The warm-up compiled both paths: nothing compiles here."""
    knobs = compile_hook_knobs()
    engine = LLMEngine.from_args(EngineArgs(
        "synthetic:tiny", device="cuda", dtype="bfloat16", max_model_len=BUDGET + 64, max_num_seqs=64,
        max_num_batched_tokens=BUDGET, enable_lora=True, max_loras=8, max_lora_rank=64))
    runtime = engine.lora_manager.runtime
    assert runtime.gemm_columns and runtime.columns_may_overflow
    for i in range(4):
        engine.lora_manager.register_adapter(f"b{i}", random_adapter(runtime.spec, f"b{i}", 64, seed=10 + i))
    compiled: list[str] = []
    monkeypatch.setattr(knobs, "jit_post_compile_hook",
                        lambda *args, **kwargs: compiled.append(str(getattr(kwargs.get("fn"), "name", None))))
    rng = np.random.default_rng(1)
    short = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    for length in (150, 240):  # four prompts in one step: 600 and 960 tokens
        for i in range(4):
            engine.add_request(f"r{length}-{i}", rng.integers(0, engine.hf_config.vocab_size, length).tolist(), short,
                               LoRARequest(f"b{i}"))
        run_to_end(engine)
    assert compiled == [], f"kernels compiled after start-up: {compiled}"
