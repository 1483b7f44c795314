"""Engine options as a vLLM user sets them: another tokenizer folder (--tokenizer), another chat template
(--chat-template, a file or the template itself), the engine flags that reach EngineArgs, and the progress
bar of loading the weights."""
import argparse
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from loraserve import LLM, SamplingParams
from loraserve.entrypoints.cli import add_generate_arguments
from loraserve.entrypoints.engine_flags import engine_args
from loraserve.errors import ModelLoadError

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def _chat_prompt_ids(llm) -> list[int]:
    out = llm.chat(MESSAGES, use_tqdm=False)[0]
    return out.prompt_token_ids


def test_a_tokenizer_folder_replaces_the_models(model, tmp_path):
    other = AutoTokenizer.from_pretrained(model)
    other.chat_template = TEMPLATE
    other.save_pretrained(tmp_path / "tok")
    llm = LLM(model, device="cpu", max_model_len=64, tokenizer=str(tmp_path / "tok"))
    reference = AutoTokenizer.from_pretrained(tmp_path / "tok")
    want = reference(reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    assert _chat_prompt_ids(llm) == want
    assert llm.get_tokenizer().chat_template == TEMPLATE != AutoTokenizer.from_pretrained(model).chat_template


def test_a_chat_template_replaces_the_tokenizers(model):
    llm = LLM(model, device="cpu", max_model_len=64, chat_template=TEMPLATE)
    reference = AutoTokenizer.from_pretrained(model)
    text = reference.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert text == "<<user: Hello there>>=>"
    assert _chat_prompt_ids(llm) == reference(text, add_special_tokens=False)["input_ids"]
    plain = LLM(model, device="cpu", max_model_len=64)  # vLLM's form: the template for one call
    assert plain.chat(MESSAGES, use_tqdm=False, chat_template=TEMPLATE)[0].prompt_token_ids == _chat_prompt_ids(llm)


def test_a_missing_tokenizer_folder_is_named(model):
    with pytest.raises(ModelLoadError, match="/nonexistent/tok"):
        LLM(model, device="cpu", max_model_len=64, tokenizer="/nonexistent/tok")


def test_engine_flags_reach_the_engine_args(tmp_path):
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(TEMPLATE)
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    args = parser.parse_args(["Hi", "--max-num-batched-tokens", "512", "--block-size", "32",
                              "--gpu-memory-utilization", "0.5", "--tokenizer", "/some/tok",
                              "--chat-template", str(template_file)])
    options = engine_args(args, enable_lora=False)
    assert (options.max_num_batched_tokens, options.block_size, options.gpu_memory_utilization) == (512, 32, 0.5)
    assert (options.tokenizer, options.chat_template) == ("/some/tok", TEMPLATE)
    inline = parser.parse_args(["Hi", "--chat-template", TEMPLATE])
    assert engine_args(inline, enable_lora=False).chat_template == TEMPLATE
    assert not options.disable_custom_all_reduce
    nccl_only = engine_args(parser.parse_args(["Hi", "--disable-custom-all-reduce"]), enable_lora=False)
    assert nccl_only.create_config(4096).parallel.disable_custom_all_reduce


def test_a_chat_template_that_is_neither_file_nor_template_is_a_usage_error(model):
    proc = subprocess.run([sys.executable, "-m", "loraserve.entrypoints.cli", "generate", "Hi", "--model", model,
                           "--device", "cpu", "--chat-template", "/nonexistent/chat.jinja"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "neither a chat template file nor a template" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_loading_shows_a_progress_bar_with_a_total(model, monkeypatch):
    """The weights' progress bar knows how many tensors the checkpoint holds (read from the headers)."""
    import glob

    from safetensors import safe_open

    from loraserve.models import loader

    seen = []

    def recording_tqdm(iterable, **kwargs):
        seen.append(kwargs)
        return iterable

    monkeypatch.setattr(loader, "tqdm", recording_tqdm)
    LLM(model, device="cpu", max_model_len=64)
    want = 0
    for file in glob.glob(f"{model}/*.safetensors"):
        with safe_open(file, framework="pt") as f:
            want += len(list(f.keys()))
    assert [k["total"] for k in seen if k.get("desc") == "Loading weights"] == [want]


def test_a_repo_id_loads_from_the_hf_cache_and_nothing_is_downloaded(model, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    by_id = LLM("acme/tiny-llama", device="cpu", max_model_len=64)
    assert by_id.engine.model_name == "acme/tiny-llama"
    by_folder = LLM(model, device="cpu", max_model_len=64)
    greedy = dict(prompt_token_ids=[5, 17, 42, 9])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert by_id.generate(greedy, params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_folder.generate(greedy, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ModelLoadError, match="'acme/missing' is not a local folder and not in the Hugging Face cache"):
        LLM("acme/missing", device="cpu", max_model_len=64)
