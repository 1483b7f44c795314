"""Adapters served by name from `lora_root` on their first request (CPU, tiny Llama).

An adapter named without a path and not registered is the folder `<lora_root>/<name>`: the first request
registers it and gets the same tokens as the adapter registered explicitly; names that lead out of the
root (`..`, absolute, symlinks) and broken folders fail that request alone; a missing folder is
UnknownLoRAError.
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading

import pytest
from model_fixtures import make_lora_adapters

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine, GenerationRequest
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.cli import main as cli_main
from loraserve.errors import InvalidRequestError, UnknownLoRAError
from loraserve.lora.adapter import LoRAAdapterError
from loraserve.lora.resolver import LoRAPathOutsideRootError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    """A tiny model, a root with adapters `sql` and `team/chat`, an adapter outside the root, and folders
    inside the root that lead out of it or are broken."""
    model = tiny_model_factory("llama")
    base = tmp_path_factory.mktemp("lora-root")
    root, outside = base / "adapters", base / "outside"
    specs = [{"name": "sql", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
             {"name": "team/chat", "r": 8, "target_modules": ["o_proj", "down_proj"]}]
    sql, chat = make_lora_adapters(model, root, specs)
    (evil,) = make_lora_adapters(model, outside, [{"name": "evil", "r": 4, "target_modules": ["q_proj"]}], seed=3)
    os.symlink(evil, root / "link-out")  # the folder itself leads out
    inner = root / "inner-link"  # a folder whose weights lead out
    inner.mkdir()
    shutil.copy(os.path.join(sql, "adapter_config.json"), inner)
    os.symlink(os.path.join(evil, "adapter_model.safetensors"), inner / "adapter_model.safetensors")
    os.symlink(sql, root / "sql-alias")  # a symlink that stays inside the root is fine
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(sql, "adapter_config.json"), no_weights)
    broken = root / "broken"
    shutil.copytree(sql, broken)
    (broken / "adapter_config.json").write_text("{not json")
    return {"model": model, "root": str(root), "outside": str(outside), "sql": sql, "chat": chat, "evil": evil}


@pytest.fixture(scope="module")
def llm(setup):
    return LLM(setup["model"], device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16,
               lora_root=setup["root"])


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _drain(engine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_first_request_loads_the_adapter_like_an_explicit_registration(setup):
    llm = LLM(setup["model"], device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16,
              lora_root=setup["root"])
    assert llm.list_loras() == []
    by_name = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[LoRARequest("sql", 1), LoRARequest("team/chat")])
    assert [o.lora_name for o in by_name] == ["sql", "team/chat"] and all(o.error is None for o in by_name)
    assert sorted(llm.list_loras()) == ["sql", "team/chat"]
    assert llm.engine.lora_manager.paths["sql"] == os.path.realpath(setup["sql"])

    explicit = LLM(setup["model"], device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16)
    explicit.add_lora(LoRARequest("sql", setup["sql"]))
    explicit.add_lora(LoRARequest("team/chat", setup["chat"]))
    expected = explicit.generate([PROMPT, PROMPT], GREEDY, lora_request=[LoRARequest("sql"), LoRARequest("team/chat")])
    assert _tokens(by_name) == _tokens(expected)
    base = explicit.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert _tokens(by_name)[0] != base and _tokens(by_name)[1] != base  # the adapters were applied
    # once registered, the adapter is used again without reading its folder
    assert _tokens(llm.generate(PROMPT, GREEDY, LoRARequest("sql")))[0] == _tokens(by_name)[0]
    # without a lora root, a name alone still has to be registered first
    with pytest.raises(UnknownLoRAError, match="'sql'"):
        LLM(setup["model"], device="cpu", max_model_len=64, enable_lora=True).generate(
            PROMPT, GREEDY, LoRARequest("sql"))


def test_a_symlink_inside_the_root_is_served(setup, llm):
    out = llm.generate(PROMPT, GREEDY, LoRARequest("sql-alias"))[0]
    assert out.error is None and "sql-alias" in llm.list_loras()


PARTS = "has an empty, '.' or '..' part"
ESCAPES = {  # name -> what the message says
    "../outside/evil": PARTS,
    "sql/../../outside/evil": PARTS,
    "sql/..": PARTS,
    "./sql": PARTS,
    "team//chat": PARTS,
    "link-out": "resolves outside the lora root",
    "inner-link": "'adapter_model.safetensors' in LoRA adapter 'inner-link' links outside the lora root",
}


def test_names_that_leave_the_root_fail_alone_and_the_batch_finishes(setup, llm):
    engine = llm.engine
    expected = {"sql": _tokens(llm.generate(PROMPT, GREEDY, LoRARequest("sql"))),
                "base": _tokens(llm.generate(PROMPT, GREEDY))}
    before = sorted(llm.list_loras())
    engine.add_request("keep-sql", PROMPT, GREEDY, LoRARequest("sql"))
    absolute = "is an absolute path"
    escapes = {**ESCAPES, os.path.join(setup["root"], "sql"): absolute, setup["evil"]: absolute}
    for i, (name, message) in enumerate(escapes.items()):
        with pytest.raises(LoRAPathOutsideRootError) as info:
            engine.add_request(f"bad-{i}", PROMPT, GREEDY, LoRARequest(name))
        assert message in str(info.value) and repr(name) in str(info.value), (name, str(info.value))
        assert isinstance(info.value, InvalidRequestError)  # a bad request (HTTP 400)
    engine.add_request("keep-base", PROMPT, GREEDY)
    done = _drain(engine)
    assert set(done) == {"keep-sql", "keep-base"}
    assert [done["keep-sql"].outputs[0].token_ids] == expected["sql"]
    assert [done["keep-base"].outputs[0].token_ids] == expected["base"]
    assert sorted(llm.list_loras()) == before and not engine.lora_manager.refcounts
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_missing_and_broken_adapters(setup, llm):
    with pytest.raises(UnknownLoRAError, match="'nope'"):
        llm.generate(PROMPT, GREEDY, LoRARequest("nope"))
    with pytest.raises(UnknownLoRAError, match="'team/nope'"):
        llm.generate(PROMPT, GREEDY, LoRARequest("team/nope"))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        llm.generate(PROMPT, GREEDY, LoRARequest("team"))  # a folder of adapters, not an adapter
    with pytest.raises(InvalidRequestError, match="no adapter_model.safetensors"):
        llm.generate(PROMPT, GREEDY, LoRARequest("no-weights"))
    with pytest.raises(LoRAAdapterError, match="broken"):
        llm.generate(PROMPT, GREEDY, LoRARequest("broken"))
    for name in ("nope", "team/nope", "team", "no-weights", "broken"):
        assert name not in llm.list_loras()
    assert llm.generate(PROMPT, GREEDY, LoRARequest("sql"))[0].error is None  # the engine keeps serving


def test_an_explicit_path_is_not_bound_to_the_root(setup, llm):
    """A LoRARequest with a path registers that folder, as without a lora root."""
    out = llm.generate(PROMPT, GREEDY, LoRARequest("evil-explicit", setup["evil"]))[0]
    assert out.error is None and "evil-explicit" in llm.list_loras()


def test_the_async_engine_reads_a_root_adapter_off_the_engine_thread(setup):
    llm = LLMEngine.from_args(EngineArgs(setup["model"], device="cpu", max_model_len=64, enable_lora=True,
                                         max_lora_rank=16, lora_root=setup["root"]))
    reads, read = [], llm.load_lora_weights
    llm.load_lora_weights = lambda req: reads.append((req.name, threading.current_thread().name)) or read(req)

    async def main():
        engine = AsyncLLMEngine(llm)
        engine.start()
        try:
            outs = [o async for o in engine.generate("first", [5, 6, 7, 8], GREEDY, LoRARequest("sql"))]
            again = [o async for o in engine.generate("again", [5, 6, 7, 8], GREEDY, LoRARequest("sql"))]
            for name, error in (("nope", UnknownLoRAError), ("../outside/evil", LoRAPathOutsideRootError)):
                with pytest.raises(error, match=re.escape(repr(name))):
                    await engine.add_requests([GenerationRequest("bad", [5, 6], GREEDY, LoRARequest(name))])
            return outs[-1], again[-1], await engine.list_loras()
        finally:
            engine.shutdown(drain=False)

    first, again, registered = asyncio.run(main())
    assert first.error is None and len(first.outputs[0].token_ids) == GREEDY.max_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert registered == ["sql"]
    assert len(reads) == 1 and reads[0][0] == "sql" and reads[0][1] != "loraserve-engine"


def test_lora_request_forms():
    assert LoRARequest("a") == LoRARequest("a", None) and LoRARequest("a").path is None
    assert LoRARequest("a", "/x").path == "/x"
    vllm = LoRARequest("a", 7, "/x")  # vLLM's LoRARequest(name, int_id, path)
    assert (vllm.path, vllm.lora_int_id) == ("/x", 7) and vllm == LoRARequest("a", "/x")
    assert LoRARequest("a", 7).path is None and LoRARequest("a", "").path is None
    for bad in [("",), ("a", 1.5), ("a", True), ("a", 1, 2)]:
        with pytest.raises(ValueError):
            LoRARequest(*bad)
    keywords = LoRARequest(lora_name="a", lora_int_id=7, lora_path="/x")  # vLLM's keywords
    assert keywords == vllm and (keywords.lora_name, keywords.lora_path, keywords.lora_int_id) == ("a", "/x", 7)
    assert LoRARequest("a", 3, lora_path="/x") == vllm and LoRARequest(lora_name="a").path is None
    with pytest.raises(ValueError, match="once"):
        LoRARequest("a", lora_name="b")


def test_generate_command_takes_adapters_from_a_root(setup, capsys):
    common = ["generate", "Hello", "--model", setup["model"], "--device", "cpu", "--max-model-len", "64",
              "--max-tokens", "3", "--ignore-eos", "--lora-root", setup["root"]]
    assert cli_main(common + ["--use-lora", "sql"]) == 0
    assert "[3 tokens, finish: length]" in capsys.readouterr().out
    assert cli_main(common + ["--use-lora", "../outside/evil"]) == 2
    assert "'..'" in capsys.readouterr().err
