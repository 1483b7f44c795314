"""Bounded load on localhost: 64 concurrent streaming clients over 4 adapters and the base model.

For LORASERVE_LOAD_SECONDS (default 60) seconds, while two more adapters are loaded and
unloaded over and over and a tenth of the clients hang up mid-stream: no 5xx, every
finished stream is well-formed SSE, and afterwards /metrics shows every KV block free and
no adapter referenced by a request.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from model_fixtures import make_lora_adapters
from server_harness import metric, serve, wait_until_idle

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.server import ServerSettings
from loraserve.lora.request import LoRARequest

CLIENTS = 64
DISCONNECTING = range(0, CLIENTS, 10)  # 7 of 64 clients hang up mid-stream
STABLE = ["s0", "s1", "s2", "s3"]
CHURN = ["c0", "c1"]  # loaded and unloaded during the run
KEY = "load-key"
WORDS = "the quick brown fox jumps over a lazy dog while serving many adapters".split()


@pytest.fixture(scope="module")
def load_server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("load-loras")
    specs = [dict(name=name, r=4 + 4 * (i % 3), lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
             for i, name in enumerate(STABLE + CHURN)]
    paths = dict(zip(STABLE + CHURN, make_lora_adapters(model, root, specs)))
    llm = LLMEngine.from_args(EngineArgs(model, device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16,
                                         max_cpu_loras=4, max_num_seqs=16, max_model_len=256))
    for name in STABLE:
        llm.add_lora(LoRARequest(name, paths[name]))
    engine = AsyncLLMEngine(llm, max_waiting_requests=4 * CLIENTS)
    engine.start()
    settings = ServerSettings(api_key=KEY, enable_runtime_lora_updates=True, lora_roots=(str(root),),
                              lora_modules=tuple((n, paths[n]) for n in STABLE))
    try:
        with serve(engine, settings) as url:
            yield url, engine.model_name, paths
    finally:
        engine.shutdown(drain=False)


def check_stream(lines: list[str], chat: bool, max_tokens: int) -> None:
    """A complete stream: data lines only, one id, one finish_reason, usage, then [DONE]."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), finishes
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and 1 <= usage["completion_tokens"] <= max_tokens
    assert finishes[0] == "stop" or usage["completion_tokens"] == max_tokens


async def client_loop(i: int, http: httpx.AsyncClient, base: str, deadline: float, tally: Counter) -> None:
    rng = random.Random(i)
    while time.monotonic() < deadline:
        model = rng.choice([base] + STABLE + CHURN)
        chat = rng.random() < 0.5
        max_tokens = rng.randint(2, 10)
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "temperature": rng.choice([0.0, 0.8]), "seed": i, "ignore_eos": rng.random() < 0.5}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with http.stream("POST", path, json=body) as response:
            tally[f"status {response.status_code}"] += 1
            if response.status_code != 200:
                await response.aread()
                assert response.status_code < 500, response.text
                assert response.status_code == 404 and model in CHURN, (model, response.text)
                continue
            lines = []
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                if i in DISCONNECTING and len(lines) == 2:
                    break  # hang up mid-stream
            if i in DISCONNECTING and lines[-1] != "data: [DONE]":
                tally["hung up"] += 1
                continue
        check_stream(lines, chat, max_tokens)
        tally["complete"] += 1


async def churn_loop(http: httpx.AsyncClient, paths: dict, deadline: float, tally: Counter) -> None:
    step = 0
    while time.monotonic() < deadline:
        name = CHURN[step % 2]
        for path, body in (("/v1/load_lora_adapter", {"lora_name": name, "lora_path": paths[name]}),
                           ("/v1/unload_lora_adapter", {"lora_name": name})):
            await asyncio.sleep(0.3)
            response = await http.post(path, json=body)
            # 409: a reload while the last unload still waits for its requests; 404: unloaded already.
            assert response.status_code in (200, 404, 409), response.text
            tally[f"{path} {response.status_code}"] += 1
        scrape = (await http.get("/metrics")).text
        for family in text_string_to_metric_families(scrape):
            if family.name == "loraserve_lora_requests_in_flight" and any(s.value > 0 for s in family.samples):
                tally["adapter references seen"] += 1
        step += 1


async def run_load(url: str, base: str, paths: dict, seconds: float) -> Counter:
    tally: Counter = Counter()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, limits=limits,
                                 timeout=httpx.Timeout(120)) as http:
        tasks = [client_loop(i, http, base, deadline, tally) for i in range(CLIENTS)]
        await asyncio.wait_for(asyncio.gather(churn_loop(http, paths, deadline, tally), *tasks),
                               timeout=seconds + 120)
    return tally


@pytest.mark.slow
def test_load_with_adapter_churn_and_disconnects(load_server):
    url, base, paths = load_server
    seconds = float(os.environ.get("LORASERVE_LOAD_SECONDS", "60"))
    tally = asyncio.run(run_load(url, base, paths, seconds))
    print(dict(tally))
    assert tally["complete"] >= CLIENTS and tally["hung up"] >= len(DISCONNECTING)
    assert tally["/v1/load_lora_adapter 200"] >= 1 and tally["/v1/unload_lora_adapter 200"] >= 1
    assert tally["adapter references seen"] >= 1  # the metric read below does count references
    samples = wait_until_idle(url)
    assert metric(samples, "loraserve_kv_cache_blocks_used") == 0
    assert metric(samples, "loraserve_num_requests_running") == metric(samples, "loraserve_num_requests_waiting") == 0
    refs = {labels: v for (name, labels), v in samples.items() if name == "loraserve_lora_requests_in_flight"}
    assert all(v == 0 for v in refs.values()), refs
    outcomes = Counter()
    for (name, labels), value in samples.items():
        if name == "loraserve_requests_total":
            outcomes[dict(labels)["outcome"]] += value
    assert outcomes["error"] == outcomes["overloaded"] == 0, outcomes
    assert outcomes["aborted"] >= len(DISCONNECTING) and outcomes["success"] >= tally["complete"]
