"""Bad input gets a ValueError naming the problem, and the engine keeps serving."""
import json
import os
import shutil

import pytest

from loraserve import LLM, SamplingParams
from loraserve.errors import ModelLoadError, PromptTooLongError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), device="cpu", max_model_len=64)


def test_bad_requests_raise_and_engine_keeps_serving(tiny_llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    expected = tiny_llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        tiny_llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        tiny_llm.generate({"prompt_token_ids": [5] * 64}, GREEDY)
    with pytest.raises(ValueError, match="token ids must be integers"):
        tiny_llm.generate({"prompt_token_ids": [5, 10**9]}, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # a failing prompt in a list adds none of the list
    with pytest.raises(PromptTooLongError):
        tiny_llm.generate([prompt, {"prompt_token_ids": [5] * 100}], GREEDY)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    engine = tiny_llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks_and_others_finish(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("keep", [5, 6, 7], GREEDY)
    engine.add_request("drop", [8, 9, 10, 11], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("no-such-request")  # no-op
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/no/such/model", device="cpu")


def test_missing_weight_files(tiny_model_factory, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model_factory("llama"), folder)
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            os.remove(folder / f)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(folder), device="cpu")


def test_missing_shard(tiny_model_factory, tmp_path):
    folder = tmp_path / "missing-shard"
    shutil.copytree(tiny_model_factory("llama", shards=True), folder)
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    os.remove(folder / shard)
    with pytest.raises(ModelLoadError, match=shard):
        LLM(str(folder), device="cpu")


def test_unsupported_architecture(tiny_model_factory, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_factory("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM"):
        LLM(str(folder), device="cpu")


def test_max_model_len_above_model_limit(tiny_model_factory):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_model_factory("llama"), device="cpu", max_model_len=10**6)


def test_a_sliding_window_does_not_bound_max_model_len(tiny_model_factory):
    """Sliding-window layers attend to their window at any length (tests/models/test_architectures.py): the
    window no longer caps max_model_len."""
    folder = tiny_model_factory("mistral", sliding_window=64)
    assert LLM(folder, device="cpu").engine.max_model_len == 512  # the model's max_position_embeddings
    assert LLM(folder, device="cpu", max_model_len=300).engine.max_model_len == 300
