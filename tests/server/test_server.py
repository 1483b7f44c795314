"""The OpenAI-compatible server on localhost, driven by the real `openai` client.

One tiny random Llama served with API key, runtime adapter updates and a
--lora-root; every endpoint, the streaming format, adapters by name, load and
unload (with requests in flight), client disconnects, and each error status.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer
from hf_reference import load_hf_model, teacher_forced_logprobs
from model_fixtures import make_lora_adapters
from server_harness import metric, read_metrics, serve, wait_until_idle

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.server import ServerSettings
from loraserve.lora.request import LoRARequest

KEY = "test-key"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def paths(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    base = tmp_path_factory.mktemp("server")
    root, outside = base / "loras", base / "outside"
    specs = [dict(name="a0", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
             dict(name="a1", r=8, lora_alpha=8, target_modules=MODULES),
             dict(name="a2", r=8, lora_alpha=16, target_modules=["o_proj", "down_proj"]),
             dict(name="big", r=32, lora_alpha=32, target_modules=["q_proj"])]
    adapters = dict(zip([s["name"] for s in specs], make_lora_adapters(model, root, specs)))
    make_lora_adapters(model, outside, [dict(name="evil", r=4, target_modules=["q_proj"])])
    return {"model": model, "root": str(root), "outside": str(outside), **adapters}


@pytest.fixture(scope="module")
def engine(paths):
    llm = LLMEngine.from_args(EngineArgs(paths["model"], device="cpu", enable_lora=True, max_loras=2,
                                         max_lora_rank=16, max_cpu_loras=4, max_num_seqs=8,
                                         max_model_len=MAX_MODEL_LEN))
    for name in ("a0", "a1"):
        llm.add_lora(LoRARequest(name, paths[name]))
    async_engine = AsyncLLMEngine(llm, max_waiting_requests=4)
    async_engine.start()
    yield async_engine
    async_engine.shutdown(drain=False)


@pytest.fixture(scope="module")
def url(engine, paths):
    settings = ServerSettings(api_key=KEY, enable_runtime_lora_updates=True, lora_roots=(paths["root"],),
                              lora_modules=(("a0", paths["a0"]), ("a1", paths["a1"])))
    with serve(engine, settings) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base(engine):
    return engine.model_name


def status_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


def load(client, name, path):
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path}, cast_to=httpx.Response)


def unload(client, name):
    return client.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=httpx.Response)


# ---- generation ------------------------------------------------------------------------------------


def test_completion_matches_its_stream_and_counts_usage(client, base, engine):
    kw = dict(model=base, prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=2)
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6
    prompt_len = len(engine.tokenizer.encode("The quick brown fox"))
    assert full.usage.prompt_tokens == prompt_len and full.usage.total_tokens == prompt_len + 6
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == choice.text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_n_choices_with_seed_are_reproducible(client, base):
    kw = dict(model=base, prompt=["Hello", "Serving many adapters"], max_tokens=5, n=2, seed=7, temperature=1.0,
              presence_penalty=0.0)  # unsupported fields are accepted with their neutral value
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 20


def test_stop_string_cuts_text_in_full_and_streamed_answers(client, base):
    text = client.completions.create(model=base, prompt="Hello, world!", max_tokens=12, temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    kw = dict(model=base, prompt="Hello, world!", max_tokens=12, temperature=0, stop=[stop])
    cut = client.completions.create(**kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == cut.text


def test_chat_full_and_streamed(client, base):
    kw = dict(model="a1", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
              max_tokens=5, temperature=0)
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and full.model == "a1"
    assert len(choice.logprobs.content) == 5 and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


@pytest.fixture(scope="module")
def hf(paths):
    return load_hf_model(paths["model"])


def test_prompt_logprobs_in_vllms_shape(client, url, base, paths, hf):
    """prompt_logprobs (vLLM's, through extra_body) equal HF's teacher-forced logprobs: per prompt token the
    token itself and the top k, with their ranks and text; in each completion choice, and at the top of a chat
    completion; refused with stream and out of range."""
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    prompt = tokenizer("The quick brown fox jumps over", add_special_tokens=False)["input_ids"]
    answer = client.completions.create(model=base, prompt=prompt, max_tokens=2, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 2})
    reference = teacher_forced_logprobs(hf, prompt[:1], prompt[1:])  # [P-1, V]
    got = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    assert answer.choices[1].model_extra["prompt_logprobs"] == got  # every choice carries its prompt's
    for pos in range(1, len(prompt)):
        want = reference[pos - 1]
        top = want.topk(2).indices.tolist()
        assert set(got[pos]) == {str(t) for t in {prompt[pos], *top}}, pos
        for token, item in got[pos].items():
            assert abs(item["logprob"] - float(want[int(token)])) < 1e-4, (pos, token)
            assert item["decoded_token"] == tokenizer.decode([int(token)])
            assert item["rank"] == (top.index(int(token)) + 1 if int(token) in top else None)
    assert "prompt_logprobs" not in client.completions.create(model=base, prompt=prompt, max_tokens=1).choices[0].model_extra
    with_adapter = client.completions.create(model="a1", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    changed = with_adapter.choices[0].model_extra["prompt_logprobs"]
    assert [list(e) for e in changed[1:]] == [[str(t)] for t in prompt[1:]]  # k = 0: the prompt's tokens alone
    assert any(abs(changed[p][str(prompt[p])]["logprob"] - got[p][str(prompt[p])]["logprob"]) > 1e-4
               for p in range(1, len(prompt)))  # scored with the adapter

    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model=base, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 1})
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    top = chat.model_extra["prompt_logprobs"]
    assert len(top) == len(ids) and top[0] is None and all(str(t) in e for t, e in zip(ids[1:], top[1:]))
    for extra, message in (({"prompt_logprobs": 2}, "stream=true"), ({"prompt_logprobs": 21}, "[0, 20]")):
        status, body = status_of(lambda extra=extra: client.completions.create(
            model=base, prompt="Hi", max_tokens=2, stream="stream" in message, extra_body=extra))
        assert status == 400 and body["param"] == "prompt_logprobs" and message in body["message"], body


def test_echo_returns_and_scores_the_prompt(client, base, paths, hf):
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    text = "Serving many adapters at once"
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    scored = client.completions.create(model=base, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(prompt) and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt] and lp.token_logprobs[0] is None
    reference = teacher_forced_logprobs(hf, prompt[:1], prompt[1:])
    for pos in range(1, len(prompt)):
        assert abs(lp.token_logprobs[pos] - float(reference[pos - 1][prompt[pos]])) < 1e-4, pos
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    plain = client.completions.create(model=base, prompt=text, max_tokens=4, temperature=0, logprobs=1)
    echoed = client.completions.create(model=base, prompt=text, max_tokens=4, temperature=0, logprobs=1, echo=True)
    assert echoed.choices[0].text == text + plain.choices[0].text
    prompt_len = echoed.usage.prompt_tokens
    assert len(echoed.choices[0].logprobs.tokens) == prompt_len + 4 and echoed.usage.completion_tokens == 4
    assert echoed.choices[0].logprobs.token_logprobs[prompt_len:] == plain.choices[0].logprobs.token_logprobs
    streamed = list(client.completions.create(model=base, prompt=text, max_tokens=4, temperature=0, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    status, body = status_of(lambda: client.completions.create(model=base, prompt=text, max_tokens=0))
    assert status == 400 and body["param"] == "max_tokens"  # nothing to do without echo


def test_continuous_usage_in_every_chunk(client, base):
    chunks = list(client.completions.create(
        model=base, prompt="Hello", max_tokens=4, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    per_choice = {}
    for chunk in chunks[:-1]:
        per_choice.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    assert set(per_choice) == {0, 1} and all(counts == sorted(counts) and counts[-1] == 4
                                             for counts in per_choice.values())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    status, body = status_of(lambda: client.completions.create(model=base, prompt="Hi", max_tokens=2, stream=True,
                                                               stream_options={"include_usage": True, "x": 1}))
    assert status == 400 and "stream_options.x" in body["message"]


def test_unimplemented_fields_are_neutral_or_a_clear_400(client, base):
    kw = dict(model=base, prompt="Hi", max_tokens=2)
    accepted = client.completions.create(**kw, best_of=1, extra_body={
        "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
        "response_format": {"type": "text"}})
    assert accepted.usage.completion_tokens == 2
    for extra, param, needle in (
            ({"use_beam_search": True}, "use_beam_search", "not supported"),
            ({"best_of": 3}, "best_of", "not supported"),
            ({"response_format": {"type": "json_object"}}, "response_format", "structured output"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "Unrecognized")):
        status, body = status_of(lambda extra=extra: client.completions.create(**kw, extra_body=extra))
        assert status == 400 and body["param"] == param and needle in body["message"], body
    chat = dict(model=base, max_tokens=2)
    status, body = status_of(lambda: client.chat.completions.create(
        **chat, messages=[{"role": "user", "content": "Hi"}], extra_body={"echo": True}))
    assert status == 400 and body["param"] == "echo"
    status, body = status_of(lambda: client.chat.completions.create(**chat, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]))
    assert status == 400 and "tool calls are not supported" in body["message"]
    sent_back = {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None}  # as a client got it
    answer = client.chat.completions.create(**chat, messages=[{"role": "user", "content": "Hi"}, sent_back,
                                                              {"role": "user", "content": "Again"}])
    assert answer.usage.completion_tokens == 2


def test_adapters_change_the_output(client, base):
    def first_logprob(model):
        r = client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0, logprobs=0)
        return r.choices[0].logprobs.token_logprobs[0]

    values = [first_logprob(m) for m in (base, "a0", "a1")]
    assert len({round(v, 5) for v in values}) == 3, values


def test_models_list_and_retrieve(client, base, paths):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {base, "a0", "a1"}
    assert models[base].parent is None and models["a0"].parent == base and models["a1"].parent == base
    assert models["a0"].root == paths["a0"]
    assert client.models.retrieve("a1").parent == base
    assert status_of(lambda: client.models.retrieve("nope"))[0] == 404


# ---- runtime adapters --------------------------------------------------------------------------------


def test_load_use_and_unload_while_in_flight(client, url, base, paths):
    response = load(client, "a2", os.path.join(paths["root"], "a2"))
    assert response.status_code == 200
    assert "a2" in {m.id for m in client.models.list().data}
    stream = client.completions.create(model="a2", prompt="Hello", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = [next(stream)]
    assert unload(client, "a2").status_code == 200  # the request in flight keeps its adapter
    assert metric(read_metrics(url), "loraserve_lora_requests_in_flight", adapter="a2") == 1
    status, body = status_of(lambda: client.completions.create(model="a2", prompt="Hello", max_tokens=2))
    assert status == 404 and "a2" in body["message"]
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == 200
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert "a2" not in {m.id for m in client.models.list().data}
    assert metric(wait_until_idle(url), "loraserve_lora_requests_in_flight", adapter="a2") == 0
    assert status_of(lambda: unload(client, "a2"))[0] == 404


def test_load_conflicts(client, base, paths):
    assert status_of(lambda: load(client, "a0", paths["a2"]))[0] == 409
    assert status_of(lambda: load(client, base, paths["a2"]))[0] == 409
    assert load(client, "a0", paths["a0"]).status_code == 200  # same name and path: nothing to do


def _bad_adapters(paths):
    root = paths["root"]
    cases = {"dotdot": (os.path.join(root, "..", "outside", "evil"), "lora root")}
    os.symlink(os.path.join(paths["outside"], "evil"), os.path.join(root, "link-out"))
    cases["symlink"] = (os.path.join(root, "link-out"), "lora root")
    inner = os.path.join(root, "inner-link")
    os.makedirs(inner)
    shutil.copy(os.path.join(paths["a0"], "adapter_config.json"), inner)
    os.symlink(os.path.join(paths["outside"], "evil", "adapter_model.safetensors"),
               os.path.join(inner, "adapter_model.safetensors"))
    cases["inner-symlink"] = (inner, "lora root")
    pickle_only = os.path.join(root, "pickle-only")
    os.makedirs(pickle_only)
    shutil.copy(os.path.join(paths["a0"], "adapter_config.json"), pickle_only)
    torch.save({"x": torch.zeros(2)}, os.path.join(pickle_only, "adapter_model.bin"))
    cases["pickle"] = (pickle_only, "adapter_model.safetensors")
    for name, content, needle in (("huge-config", "{" + " " * (2 << 20) + "}", "too large"),
                                  ("broken-config", "{not json", "not valid JSON")):
        folder = os.path.join(root, name)
        shutil.copytree(paths["a0"], folder)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write(content)
        cases[name] = (folder, needle)
    cases["rank"] = (paths["big"], "max_lora_rank")
    cases["missing"] = (os.path.join(root, "does-not-exist"), "not a directory")
    return cases


def test_bad_adapters_are_refused_and_the_server_keeps_serving(client, base, paths):
    before = {m.id for m in client.models.list().data}
    for case, (path, needle) in _bad_adapters(paths).items():
        status, body = status_of(lambda: load(client, f"bad-{case}", path))
        assert status == 400 and needle in body["message"], (case, body)
    assert {m.id for m in client.models.list().data} == before
    assert client.completions.create(model="a0", prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_runtime_updates_are_off_by_default(engine):
    with serve(engine, ServerSettings()) as other:
        assert httpx.get(f"{other}/v1/models").status_code == 200  # no key configured
        response = httpx.post(f"{other}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
        assert response.status_code == 404 and "error" in response.json()


# ---- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,param", [
    (dict(top_p=1.5), "top_p"), (dict(temperature=2.5), "temperature"), (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=50), "logprobs"),
    (dict(extra_body={"frequency_penality": 1}), "frequency_penality"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 500}), "logit_bias"), (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens")])
def test_bad_values_are_400(client, base, extra, param):
    status, body = status_of(lambda: client.completions.create(model=base, prompt="Hi", **{"max_tokens": 2, **extra}))
    assert status == 400 and body["param"] == param and body["type"] == "invalid_request_error"


def test_vllm_sampling_options(client, base, paths):
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    token = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(model=base, prompt="Once", max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([token] * 3)
    free = client.completions.create(model=base, prompt="Once", max_tokens=8, temperature=0, presence_penalty=0.5,
                                     frequency_penalty=0.5, extra_body={"ignore_eos": True, "min_p": 0.2,
                                                                        "min_tokens": 2, "repetition_penalty": 1.2})
    free = free.choices[0].text
    stop = free[2:4]
    kept = client.completions.create(model=base, prompt="Once", max_tokens=8, temperature=0, stop=[stop],
                                     presence_penalty=0.5, frequency_penalty=0.5,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True,
                                                 "repetition_penalty": 1.2})
    assert kept.choices[0].text.endswith(stop) and free.startswith(kept.choices[0].text)


def test_prompt_too_long_is_400(client, base):
    status, body = status_of(lambda: client.completions.create(model=base, prompt=[5] * MAX_MODEL_LEN, max_tokens=2))
    assert status == 400 and body["code"] == "context_length_exceeded"
    status, body = status_of(lambda: client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": "word " * 2 * MAX_MODEL_LEN}]))
    assert status == 400 and "max_model_len" in body["message"]
    status, body = status_of(lambda: client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": "x"}], top_logprobs=2))
    assert status == 400 and body["param"] == "top_logprobs"


def test_bad_bodies_are_400_and_every_4xx_is_counted(client, url, base):
    """As OpenAI and vLLM: a wrong type, a body that is not JSON, a missing value, an image part are 400; an
    unknown model is 404 naming the models that exist; /metrics counts each as rejected."""
    before = _rejected(url)
    status, body = status_of(lambda: client.completions.create(model=base, prompt="Hi", max_tokens="many"))
    assert status == 400 and body["param"] == "max_tokens"
    status, _ = status_of(lambda: client.chat.completions.create(model=base, messages="not a list"))
    assert status == 400
    response = httpx.post(f"{url}/v1/completions", content=b'{"model": ', headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]
    status, body = status_of(lambda: client.chat.completions.create(model=base, messages=[]))
    assert status == 400 and body["param"] == "messages"
    response = httpx.post(f"{url}/v1/completions", json={"model": base}, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"  # missing, not mistyped
    status, body = status_of(lambda: client.chat.completions.create(model=base, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]))
    assert status == 400 and "'image_url' parts are not supported" in body["message"]
    status, body = status_of(lambda: client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2))
    assert status == 404 and body["code"] == "model_not_found"
    assert "'gpt-4' does not exist" in body["message"] and repr(base) in body["message"] and "'a0'" in body["message"]
    assert _rejected(url) == before + 7  # each of the seven once


def _rejected(url):
    """Requests answered 4xx so far, over every adapter label."""
    return sum(value for (name, labels), value in read_metrics(url).items()
               if name == "loraserve_requests_total" and dict(labels).get("outcome") == "rejected")


def test_api_key_guards_every_v1_route(url, base):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/load_lora_adapter"),
                             ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{url}{path}", headers=headers, json={"model": base})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/version").json() == {"version": importlib.metadata.version("loraserve")}
    assert httpx.get(f"{url}/metrics").status_code == 200
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_tokenize_and_detokenize(url, base, paths):
    reference = AutoTokenizer.from_pretrained(paths["model"])
    text = "Hello there, tokenizer!"
    for model in (base, "a0", None):  # the base model's name, an adapter's, or none
        body = {"prompt": text} if model is None else {"model": model, "prompt": text}
        got = httpx.post(f"{url}/tokenize", json=body).json()
        assert got["tokens"] == reference(text)["input_ids"] and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == MAX_MODEL_LEN
    plain = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == reference(text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{url}/tokenize", json={"model": base, "messages": messages}).json()
    templated = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == reference(templated, add_special_tokens=False)["input_ids"]
    back = httpx.post(f"{url}/detokenize", json={"model": base, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": reference.decode(plain["tokens"])}, back.text
    for path, body, status in (("/tokenize", {"model": "nope", "prompt": "x"}, 404),
                               ("/tokenize", {"prompt": "x", "messages": messages}, 400),
                               ("/tokenize", {}, 400),
                               ("/tokenize", {"prompt": "x", "unknown": 1}, 400),
                               ("/detokenize", {"tokens": [len(reference) + 5]}, 400),
                               ("/detokenize", {"model": "nope", "tokens": [1]}, 404)):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == status, (path, body, response.text)
        assert "error" in response.json()


def test_cors_preflight_is_answered_before_the_api_key(url, engine):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    response = httpx.options(f"{url}/v1/chat/completions", headers=preflight)  # no key: a browser sends none
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    listed = httpx.get(f"{url}/v1/models", headers={"Origin": "https://app.example",
                                                    "Authorization": f"Bearer {KEY}"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
    with serve(engine, ServerSettings(allowed_origins=("https://app.example",))) as strict:
        assert httpx.options(f"{strict}/v1/models", headers=preflight).headers["access-control-allow-origin"] \
            == "https://app.example"
        other = httpx.options(f"{strict}/v1/models", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_unknown_model_or_route_is_404(client, url, base):
    assert status_of(lambda: client.completions.create(model="nope", prompt="Hi", max_tokens=2))[0] == 404
    status, body = status_of(lambda: client.chat.completions.create(
        model="nope", messages=[{"role": "user", "content": "x"}]))
    assert status == 404 and body["code"] == "model_not_found"
    response = httpx.get(f"{url}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404 and "error" in response.json()


def test_full_waiting_queue_is_503_and_rolls_back(client, url, base):
    status, body = status_of(lambda: client.completions.create(model=base, prompt="Hi", max_tokens=2, n=5))
    assert status == 503 and body["code"] == "queue_full"
    assert metric(read_metrics(url), "loraserve_requests_total", adapter="__base__", outcome="overloaded") >= 1
    assert len(client.completions.create(model=base, prompt="Hi", max_tokens=2, n=4).choices) == 4


# ---- disconnects, metrics, health ---------------------------------------------------------------------------


def _aborted(url):
    return metric(read_metrics(url), "loraserve_requests_total", adapter="__base__", outcome="aborted")


def test_disconnects_abort_and_free_everything(url, base):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": base, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}
    aborted = _aborted(url)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.3))
    samples = wait_until_idle(url)
    assert metric(samples, "loraserve_kv_cache_blocks_used") == 0
    assert metric(samples, "loraserve_num_requests_running") == 0
    assert _aborted(url) == aborted + 2


def test_metrics_names(client, url, base):
    client.completions.create(model="a0", prompt="Hello", max_tokens=3)
    samples = read_metrics(url)
    names = {name for name, _ in samples}
    for name in ("loraserve_requests_total", "loraserve_num_requests_running", "loraserve_num_requests_waiting",
                 "loraserve_lora_pool_bytes_used", "loraserve_lora_pool_bytes_total", "loraserve_loras_on_gpu",
                 "loraserve_lora_gpu_loads_total", "loraserve_lora_adapter_queue_seconds_total",
                 "loraserve_loras_on_cpu", "loraserve_lora_load_seconds_count", "loraserve_kv_cache_blocks_used",
                 "loraserve_kv_cache_blocks_total", "loraserve_kv_cache_usage_ratio",
                 "loraserve_time_to_first_token_seconds_count", "loraserve_inter_token_latency_seconds_count"):
        assert name in names, name
    assert metric(samples, "loraserve_requests_total", adapter="a0", outcome="success") >= 1
    assert metric(samples, "loraserve_lora_pool_bytes_total") > metric(samples, "loraserve_lora_pool_bytes_used") > 0
    assert metric(samples, "loraserve_lora_adapter_gpu_loads_total", adapter="a0") >= 1
    assert metric(samples, "loraserve_lora_adapter_requests_started_total", adapter="a0") >= 1
    assert metric(samples, "loraserve_lora_resident", adapter="a0", location="gpu") == 1
    assert metric(samples, "loraserve_inter_token_latency_seconds_count") >= 2
