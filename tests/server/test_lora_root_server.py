"""The server with a lora root, driven by the real `openai` client: a request whose model names a folder
under the root is served without loading it first (read by the reader process); unknown names are 404, names
that lead out and broken adapters are 400, a failed reader process is 500 and is replaced; /v1/models lists the
adapter after its first use with its GPU residency."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil

import openai
import pytest
from model_fixtures import make_lora_adapters
from server_harness import serve

from loraserve.config import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.cli import build_parser
from loraserve.entrypoints.http_errors import api_error_from
from loraserve.entrypoints.serve_cli import serve_engine_args
from loraserve.entrypoints.server import ServerSettings
from loraserve.lora.reader import AdapterReaderError

KEY = "root-key"


@pytest.fixture(scope="module")
def paths(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    base = tmp_path_factory.mktemp("root-server")
    root, outside = base / "loras", base / "outside"
    specs = [{"name": name, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
             for name in ("sql", "team/chat", "par", "n-choices", "killed")]
    adapters = dict(zip([s["name"] for s in specs], make_lora_adapters(model, root, specs)))
    (evil,) = make_lora_adapters(model, outside, [{"name": "evil", "r": 4, "target_modules": ["q_proj"]}])
    os.symlink(evil, root / "link-out")
    shutil.copytree(adapters["sql"], root / "broken")
    (root / "broken" / "adapter_config.json").write_text("{not json")
    return {"model": model, "root": str(root), "evil": evil, **adapters}


@pytest.fixture(scope="module")
def engine(paths):
    llm = LLMEngine.from_args(EngineArgs(paths["model"], device="cpu", enable_lora=True, max_lora_rank=16,
                                         max_num_seqs=8, max_model_len=128, lora_root=paths["root"],
                                         lora_reader="process"))
    async_engine = AsyncLLMEngine(llm)
    async_engine.start()
    yield async_engine
    async_engine.shutdown(drain=False)
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine, paths):
    with serve(engine, ServerSettings(api_key=KEY, lora_roots=(paths["root"],))) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def status_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


def first_logprob(client, model: str) -> float:
    r = client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0, logprobs=0)
    return r.choices[0].logprobs.token_logprobs[0]


def test_a_folder_under_the_root_is_served_on_first_request(client, engine, paths):
    base = engine.model_name
    assert [m.id for m in client.models.list().data] == [base]
    answer = client.completions.create(model="sql", prompt="Hello", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.model == "sql" and answer.usage.completion_tokens == 4
    assert first_logprob(client, "sql") != first_logprob(client, base)  # the adapter changes the output
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "sql"}
    sql = cards["sql"]
    assert sql.parent == base and sql.root == os.path.realpath(paths["sql"])
    assert sql.resident_on_gpu is True  # just used, nothing evicted it
    assert cards[base].parent is None and not hasattr(cards[base], "resident_on_gpu")
    on_gpu = asyncio.run(engine.stats()).loras_on_gpu  # the engine's own account
    for card in cards.values():
        if card.id != base:
            assert card.resident_on_gpu == (card.id in on_gpu)
    assert client.models.retrieve("sql").resident_on_gpu is True


def test_nested_names_and_chat_streaming(client):
    chunks = list(client.chat.completions.create(model="team/chat", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert all(c.model == "team/chat" for c in chunks)
    card = client.models.retrieve("team/chat")
    assert card.parent is not None and card.resident_on_gpu is True


def test_concurrent_first_requests_for_one_adapter(client):
    def ask(_):
        return client.completions.create(model="par", prompt="Hello", max_tokens=2).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [2] * 4
    assert client.completions.create(model="n-choices", prompt="Hi", max_tokens=2, n=3).usage.completion_tokens == 6
    ids = [m.id for m in client.models.list().data]
    assert ids.count("par") == 1 and ids.count("n-choices") == 1


def test_unknown_names_are_404_and_escapes_are_400(client, paths):
    for name in ("nope", "team/nope"):
        status, body = status_of(lambda name=name: client.completions.create(model=name, prompt="Hi", max_tokens=2))
        assert status == 404 and body["code"] == "model_not_found" and repr(name) in body["message"], body
    status, body = status_of(lambda: client.chat.completions.create(
        model="nope", messages=[{"role": "user", "content": "Hi"}]))
    assert status == 404 and "'nope'" in body["message"]
    for name in ("../outside/evil", "link-out", paths["evil"], paths["sql"]):
        status, body = status_of(lambda name=name: client.completions.create(model=name, prompt="Hi", max_tokens=2))
        assert status == 400 and body["code"] == "path_outside_lora_root" and repr(name) in body["message"], body
    status, body = status_of(lambda: client.completions.create(model="broken", prompt="Hi", max_tokens=2))
    assert status == 400 and "broken" in body["message"] and "JSON" in body["message"], body
    listed = {m.id for m in client.models.list().data}
    assert not listed & {"nope", "team/nope", "../outside/evil", "link-out", "broken", paths["evil"]}
    assert status_of(lambda: client.models.retrieve("nope"))[0] == 404
    assert client.completions.create(model="sql", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_a_killed_reader_process_is_replaced_and_reader_failures_are_500(client, engine):
    reader = engine._engine.lora_manager.reader
    old = reader.pid
    os.kill(old, 9)
    answer = client.completions.create(model="killed", prompt="Hi", max_tokens=2)  # read by a new reader process
    assert answer.usage.completion_tokens == 2 and reader.pid not in (None, old)
    error = api_error_from(AdapterReaderError("x", "can't be read: the adapter reader process exited (exit code 1)"))
    assert (error.status, error.body()["error"]["code"]) == (500, "adapter_reader_failed")


def test_serve_flags_give_the_engine_its_root(tmp_path):
    parser = build_parser()
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    args = serve_engine_args(parser.parse_args(["serve", "--lora-root", first, "--lora-root", second]))
    assert args.enable_lora and args.lora_root == first
    args = serve_engine_args(parser.parse_args(["serve"]))
    assert not args.enable_lora and args.lora_root is None
