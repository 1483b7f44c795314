"""The OpenAI-compatible server with the architectures beyond Llama: Phi-3 (its packed qkv_proj / gate_up_proj
adapters) and Gemma 3, adapters by model name (--lora-modules and loaded at run time), driven by the `openai`
client; the answers are the offline engine's (itself checked against PEFT in tests/lora/test_arch_adapters.py)."""
from __future__ import annotations

import random

import httpx
import openai
import pytest
from server_harness import serve

from model_fixtures import WINDOW, make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.server import ServerSettings
from loraserve.models.registry import ARCHITECTURES

ARCHS = {"phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_adapters_by_name_answer_as_the_offline_engine(arch, tiny_model_factory, tmp_path):
    model = tiny_model_factory(arch)
    targets = list(ARCHITECTURES[ARCHS[arch]].peft_target_modules())
    specs = [dict(name="all", r=8, lora_alpha=16, target_modules=targets),
             dict(name="late", r=4, lora_alpha=8, target_modules=targets[:2])]
    paths = dict(zip(["all", "late"], make_lora_adapters(model, tmp_path, specs, seed=2)))
    args = dict(device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=128)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1000) for _ in range(WINDOW + 10)]  # longer than the sliding window
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    offline = LLM(model, **args)
    want = {name: offline.generate({"prompt_token_ids": prompt}, params, LoRARequest(name, path))[0]
            for name, path in paths.items()}
    llm_engine = LLMEngine.from_args(EngineArgs(model, **args))
    llm_engine.add_lora(LoRARequest("all", paths["all"]))  # as `loraserve serve --lora-modules all=PATH` does
    engine = AsyncLLMEngine(llm_engine, max_waiting_requests=4)
    engine.start()
    try:
        settings = ServerSettings(enable_runtime_lora_updates=True, lora_roots=(str(tmp_path),),
                                  lora_modules=(("all", paths["all"]),))
        with serve(engine, settings) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]},
                                  timeout=60)
            assert response.status_code == 200, response.text
            for name in ("all", "late"):
                got = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
                assert got.choices[0].text == want[name].outputs[0].text
            base = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, temperature=0)
            assert base.choices[0].text != want["all"].outputs[0].text
    finally:
        engine.shutdown(drain=False)
