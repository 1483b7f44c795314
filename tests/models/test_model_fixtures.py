"""Sanity checks of the tiny-model fixtures: they load back with transformers / PEFT and behave as promised."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from model_fixtures import LORA_STD, WINDOW, make_fallback_tokenizer, make_lora_adapters, make_tiny_model


def _load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def _safetensors(folder):
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


TIED = {"llama3_rope", "qwen3", "gemma2", "gemma3"}
MODEL_TYPE = {"llama3_rope": "llama", "gemma3": "gemma3_text", "phi3_longrope": "phi3"}


def test_each_arch_loads_and_runs(tiny_model_dir, tiny_tokenizer, request):
    arch = request.node.callspec.params["tiny_model_dir"]
    model, tok = _load(tiny_model_dir)
    config = model.config
    assert config.vocab_size == len(tok) == len(tiny_tokenizer)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, head_dim) == (64, 2, 4, 2, 16)
    assert tok.chat_template and tok.eos_token_id == config.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    norm = model.model.layers[0].input_layernorm.weight
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.2
    ids = torch.tensor([tok.encode("Tiny models still talk: hello!")])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.std().item() > 0.5  # not flat
    attn = model.model.layers[1].self_attn
    assert config.model_type == MODEL_TYPE.get(arch, arch)
    if arch == "qwen2":
        assert attn.q_proj.bias.abs().mean() > 0.02 and attn.o_proj.bias is None
    elif arch.startswith("phi3"):
        assert attn.qkv_proj.bias is None and not hasattr(attn, "q_proj")  # packed in the checkpoint
    else:
        assert attn.q_proj.bias is None
    assert config.tie_word_embeddings == (arch in TIED)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch in TIED)
    if arch == "llama3_rope":
        assert config.rope_parameters["rope_type"] == "llama3"
    elif arch == "gemma3":  # a rotary setting per layer type
        assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
        assert config.layer_types == ["sliding_attention", "full_attention"]
    else:
        assert config.rope_parameters["rope_type"] == "default"
    window = getattr(config, "sliding_window", None)
    assert window == (None if arch in ("llama", "llama3_rope", "qwen2") else WINDOW)


def test_seeded_and_sharded(tiny_model_factory):
    plain = tiny_model_factory("llama")
    sharded = tiny_model_factory("llama", shards=True)
    other_seed = tiny_model_factory("llama", seed=1)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shard_files = set(json.load(f)["weight_map"].values())
    assert len(shard_files) >= 3 and all(os.path.isfile(os.path.join(sharded, s)) for s in shard_files)
    assert not os.path.exists(os.path.join(plain, "model.safetensors.index.json"))
    a, b, c = _safetensors(plain), _safetensors(sharded), _safetensors(other_seed)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # same seed, same weights, however saved
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_overrides_reach_the_config(tiny_model_factory):
    model, _ = _load(tiny_model_factory("mistral", num_hidden_layers=3, rope_theta=20000.0))
    assert len(model.model.layers) == 3 and model.config.rope_parameters["rope_theta"] == 20000.0
    with pytest.raises(ValueError, match="unknown tiny-model arch 'gpt2'"):
        make_tiny_model("/nonexistent", "gpt2", tokenizer=make_fallback_tokenizer())


def test_adapters_load_with_peft(tiny_model_factory, tmp_path):
    from peft import PeftModel

    folder = tiny_model_factory("qwen2")
    specs = [{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "name": "attn"},
             {"r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"down_proj": 2},
              "target_modules": ["gate_proj", "up_proj", "down_proj", "o_proj"]}]
    paths = make_lora_adapters(folder, tmp_path, specs)
    assert [os.path.basename(p) for p in paths] == ["attn", "adapter1"]
    with pytest.raises(ValueError, match="must be a dict"):
        make_lora_adapters(folder, tmp_path, [["r", 8]])

    base, tok = _load(folder)
    ids = torch.tensor([tok.encode("adapters change this")] * 3)
    with torch.no_grad():
        base_logits = base(ids).logits
    model = PeftModel.from_pretrained(base, paths[0], adapter_name="attn")
    model.load_adapter(paths[1], adapter_name="mlp")
    mlp_layer = model.base_model.model.model.layers[0].mlp
    assert mlp_layer.up_proj.lora_A["mlp"].weight.shape == (4, 64)
    assert mlp_layer.down_proj.lora_A["mlp"].weight.shape == (2, 128)  # rank_pattern
    assert mlp_layer.down_proj.scaling["mlp"] == pytest.approx(8 / 2 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    b = mlp_layer.up_proj.lora_B["mlp"].weight
    assert abs(b.std().item() - LORA_STD) < 0.03  # B != 0: the adapter is not a no-op
    with torch.no_grad():
        mixed = model(ids, adapter_names=["__base__", "attn", "mlp"]).logits
    torch.testing.assert_close(mixed[0], base_logits[0])
    for row in (1, 2):
        assert (mixed[row] - base_logits[row]).abs().max() > 0.1


def test_fallback_tokenizer(tmp_path):
    tok = make_fallback_tokenizer()
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = "Any text, even ünïcode 数字 and emoji 🙂, round-trips."
    assert tok.decode(tok.encode(text)) == text
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    prompt = again.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert again.encode(text) == tok.encode(text)
