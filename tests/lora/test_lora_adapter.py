"""Tests for PEFT LoRA adapter loading and validation (loraserve.lora.adapter).

Reference: real PEFT adapters built on a tiny random Llama, saved with
`save_pretrained` and reloaded by PEFT; for every LoRA module, PEFT's output
difference (wrapped module minus base module) must equal `x @ A.T @ B_scaled.T`.
"""
import copy
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import IA3Config, LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora import Linear as PeftLoraLinear  # noqa: E402

from loraserve.lora.adapter import LoRAAdapter, LoRAAdapterError, load_lora_adapter  # noqa: E402
from loraserve.models.lora_spec import LoRAModelSpec  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAFETENSORS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def tiny_llama(intermediate_size: int = INTER) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, intermediate_size=intermediate_size, vocab_size=96,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def spec_of(model: torch.nn.Module, model_name: str | None = None) -> LoRAModelSpec:
    """The spec read off the HF model itself: every Linear of a decoder layer."""
    layer = model.model.layers[0]
    modules = {
        name.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    return LoRAModelSpec(num_layers=len(model.model.layers), modules=modules, model_name=model_name)


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture(scope="module")
def spec(base):
    return spec_of(base)


def save_peft(base_model, folder, config, safe: bool = True, dtype=None) -> str:
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base_model), config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(folder), safe_serialization=safe)
    return str(folder)


def save_lora(base_model, folder, **kwargs) -> str:
    kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    kwargs.setdefault("r", 4)
    return save_peft(base_model, folder, LoraConfig(init_lora_weights=False, **kwargs))


def peft_deltas(base_model, folder) -> dict[tuple[int, str], tuple[torch.nn.Module, int]]:
    """(layer, module) -> (PEFT's LoRA-wrapped Linear reloaded from disk, its rank)."""
    model = PeftModel.from_pretrained(copy.deepcopy(base_model), folder).eval()
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, PeftLoraLinear):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            found[(layer, parts[-1])] = (module, module.r["default"])
    return found


def assert_matches_peft(adapter: LoRAAdapter, base_model, folder) -> None:
    reference = peft_deltas(base_model, folder)
    assert set(adapter.weights) == set(reference)
    assert adapter.max_rank == max(r for _, r in reference.values())
    gen = torch.Generator().manual_seed(2)
    for key, (module, rank) in reference.items():
        a, b = adapter.weights[key]
        scale = adapter.scale_of(key)
        b_scaled = b if scale == 1 else b.to(torch.float32) * scale  # what the packer writes, before its rounding
        assert a.is_floating_point() and b_scaled.is_floating_point()
        a, b_scaled = a.float(), b_scaled.float()  # exact upcasts: the packer's cast to the model dtype rounds once
        assert a.shape == (rank, module.in_features) and b_scaled.shape == (module.out_features, rank)
        x = torch.randn(5, module.in_features, generator=gen)  # [T, in]
        with torch.no_grad():
            expected = module(x) - module.base_layer(x)  # [T, out]
        got = x @ a.T @ b_scaled.T  # [T, out]
        assert expected.abs().max() > 1e-3, "reference delta is ~0: test would be vacuous"
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


LOADING_CASES = {
    "r4_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8_all_alpha32": dict(r=8, lora_alpha=32, target_modules=ALL_MODULES),
    "r16_rslora": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"]),
    "patterns": dict(
        r=8, lora_alpha=16, target_modules=ALL_MODULES,
        rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 16},
        alpha_pattern={"v_proj": 3, "layers.0.mlp.gate_proj": 64},
    ),
    "patterns_rslora": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "up_proj"],
        rank_pattern={"up_proj": 12}, alpha_pattern={"k_proj": 5},
    ),
    "regex_targets": dict(r=4, lora_alpha=8, target_modules=r".*\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)"),
    "layers_list": dict(r=8, lora_alpha=8, target_modules=["q_proj", "gate_proj"], layers_to_transform=[1]),
    "layers_int": dict(r=4, lora_alpha=2, target_modules=["v_proj", "down_proj"], layers_to_transform=0),
    "excluded": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], exclude_modules=["model.layers.0.self_attn.o_proj"]
    ),
}


@pytest.mark.parametrize("case", sorted(LOADING_CASES))
def test_folded_weights_match_peft(base, spec, tmp_path, case):
    folder = save_lora(base, tmp_path, **LOADING_CASES[case])
    adapter = load_lora_adapter("a", folder, spec, max_lora_rank=16)
    assert adapter.name == "a" and adapter.path == folder
    assert_matches_peft(adapter, base, folder)


def test_bf16_saved_adapter(base, spec, tmp_path):
    config = LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    folder = save_peft(base, tmp_path, config, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(os.path.join(folder, SAFETENSORS)).values())
    adapter = load_lora_adapter("bf", folder, spec, max_lora_rank=8)
    assert all(a.dtype == torch.bfloat16 for a, _ in adapter.weights.values())  # kept as read, no fp32 copy
    assert_matches_peft(adapter, base, folder)


def test_bin_adapter_loads_with_weights_only(base, spec, tmp_path, monkeypatch):
    config = LoraConfig(init_lora_weights=False, r=4, lora_alpha=12, target_modules=["k_proj", "up_proj"])
    folder = save_peft(base, tmp_path, config, safe=False)
    assert not os.path.exists(os.path.join(folder, SAFETENSORS))
    real_load, calls = torch.load, []

    def spy_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy_load)
    adapter = load_lora_adapter("bin", folder, spec, max_lora_rank=8)
    monkeypatch.undo()
    assert calls == [True]
    assert_matches_peft(adapter, base, folder)


def test_adapter_name_infix_keys(base, spec, tmp_path):
    folder = save_lora(base, tmp_path, r=4, lora_alpha=8)
    path = os.path.join(folder, SAFETENSORS)
    tensors = load_file(path)
    renamed = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})
    adapter = load_lora_adapter("infix", folder, spec, max_lora_rank=8)
    assert_matches_peft(adapter, base, folder)


def test_nbytes_and_to(base, spec, tmp_path):
    config = dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, rank_pattern={"o_proj": 4})
    adapter = load_lora_adapter("n", save_lora(base, tmp_path, **config), spec, max_lora_rank=8)
    expected = sum(
        4 * (4 if m == "o_proj" else 8) * (spec.modules[m][0] + spec.modules[m][1]) for m in ALL_MODULES
    ) * LAYERS
    assert adapter.nbytes() == expected
    half = adapter.to(dtype=torch.float16)
    assert half.nbytes() == expected // 2
    assert (half.name, half.path, half.max_rank) == (adapter.name, adapter.path, adapter.max_rank)
    for key, (a, b) in adapter.weights.items():
        assert half.weights[key][0].dtype == torch.float16
        torch.testing.assert_close(half.weights[key][1].float(), b, rtol=1e-3, atol=1e-4)
    assert adapter.weights[(0, "q_proj")][0].dtype == torch.float32  # original untouched


@pytest.mark.gpu
def test_to_cuda_and_pinned(base, spec, tmp_path):
    adapter = load_lora_adapter("g", save_lora(base, tmp_path), spec, max_lora_rank=8)
    pinned = adapter.to(pin_memory=True)
    assert all(t.is_pinned() for pair in pinned.weights.values() for t in pair)
    on_gpu = pinned.to(device="cuda", dtype=torch.bfloat16)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for pair in on_gpu.weights.values() for t in pair)
    with pytest.raises(ValueError):
        adapter.to(device="cuda", pin_memory=True)


# ---------------------------------------------------------------- validation


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, CONFIG)
    with open(path) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(path, "w") as f:
        json.dump(raw, f)


def edit_tensors(folder: str, edit) -> None:
    path = os.path.join(folder, SAFETENSORS)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def key_of(tensors, module: str, part: str) -> str:
    (key,) = [k for k in tensors if f".{module}.lora_{part}" in k]
    return key


def expect_error(folder, spec, *fragments, name="bad", max_lora_rank=16):
    with pytest.raises(LoRAAdapterError) as info:
        load_lora_adapter(name, folder, spec, max_lora_rank=max_lora_rank)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert f"LoRA adapter '{name}'" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return info.value


def test_missing_folder_and_files(base, spec, tmp_path):
    expect_error(str(tmp_path / "nope"), spec, "not a directory")
    folder = save_lora(base, tmp_path / "a")
    os.remove(os.path.join(folder, CONFIG))
    expect_error(folder, spec, "missing adapter_config.json")
    folder = save_lora(base, tmp_path / "b")
    os.remove(os.path.join(folder, SAFETENSORS))
    expect_error(folder, spec, "missing weights", "adapter_model.safetensors", "adapter_model.bin")


def test_corrupt_weight_files(base, spec, tmp_path):
    folder = save_lora(base, tmp_path / "st")
    path = os.path.join(folder, SAFETENSORS)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    expect_error(folder, spec, "cannot read adapter_model.safetensors")
    config = LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj"])
    folder = save_peft(base, tmp_path / "bin", config, safe=False)
    path = os.path.join(folder, "adapter_model.bin")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    expect_error(folder, spec, "cannot read adapter_model.bin", "weights_only=True")


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"peft_type": "LORA", "r": 4, "pad": "' + "x" * (1 << 20) + '"}', "too large"),
    ],
    ids=["invalid_json", "not_object", "oversized"],
)
def test_bad_config_file(base, spec, tmp_path, content, fragment):
    folder = save_lora(base, tmp_path)
    with open(os.path.join(folder, CONFIG), "w") as f:
        f.write(content)
    expect_error(folder, spec, fragment)


def test_rank_above_max(base, spec, tmp_path):
    folder = save_lora(base, tmp_path, r=16, target_modules=["v_proj"])
    module = "model.layers.0.self_attn.v_proj"
    err = expect_error(folder, spec, f"module '{module}'", "rank 16 exceeds max_lora_rank 8", max_lora_rank=8)
    assert err.module == module


def test_unknown_target_module(base, spec, tmp_path):
    folder = save_lora(base, tmp_path)
    edit_config(folder, target_modules=["q_proj", "foo_proj", "v_proj"])
    expect_error(folder, spec, "'foo_proj'", "does not exist in the model")


def test_tensors_match_no_module(spec, tmp_path):
    """A Phi-3 adapter (fused qkv_proj) with a regex target passes the config check but fits no Llama module."""
    cfg = transformers.Phi3Config(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, intermediate_size=INTER, vocab_size=96, pad_token_id=0,
    )
    phi = transformers.Phi3ForCausalLM(cfg).eval()
    folder = save_peft(phi, tmp_path, LoraConfig(init_lora_weights=False, r=4, target_modules=r".*\.qkv_proj"))
    expect_error(folder, spec, "match no module", "qkv_proj")


def test_tensor_for_missing_module_among_good_ones(base, spec, tmp_path):
    folder = save_lora(base, tmp_path, target_modules=["q_proj", "v_proj"])

    def add_foreign(t):
        t["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = torch.randn(4, HIDDEN)
        t["base_model.model.model.layers.0.self_attn.rotary.lora_B.weight"] = torch.randn(HIDDEN, 4)

    edit_tensors(folder, add_foreign)
    expect_error(folder, spec, "model.layers.0.self_attn.rotary", "no such LoRA module")


@pytest.mark.parametrize("module, fragment", [("down_proj", "in_features"), ("gate_proj", "out_features")])
def test_shapes_of_another_model(spec, tmp_path, module, fragment):
    wider = tiny_llama(intermediate_size=2 * INTER)
    folder = save_lora(wider, tmp_path, target_modules=[module])
    expect_error(folder, spec, f"model.layers.0.mlp.{module}", fragment, str(2 * INTER))


def test_layer_out_of_range(base, tmp_path):
    folder = save_lora(base, tmp_path, target_modules=["q_proj"])
    one_layer = LoRAModelSpec(num_layers=1, modules=spec_of(base).modules)
    expect_error(folder, one_layer, "model.layers.1.self_attn.q_proj", "layer 1 does not exist")


@pytest.mark.parametrize("part, value, fragment", [("A", float("nan"), "NaN"), ("B", float("inf"), "Inf"),
                                                   ("A", float("-inf"), "Inf")])
def test_non_finite_weights(base, spec, tmp_path, part, value, fragment):
    folder = save_lora(base, tmp_path, target_modules=["q_proj", "up_proj"])

    def poison(t):
        t[key_of(t, "layers.1.mlp.up_proj", part)][1, 2] = value

    edit_tensors(folder, poison)
    expect_error(folder, spec, "model.layers.1.mlp.up_proj", f"lora_{part} contains {fragment}")


def test_missing_b_and_rank_disagreeing_with_config(base, spec, tmp_path):
    folder = save_lora(base, tmp_path / "b", target_modules=["k_proj"])
    edit_tensors(folder, lambda t: t.pop(key_of(t, "layers.1.self_attn.k_proj", "B")))
    expect_error(folder, spec, "model.layers.1.self_attn.k_proj", "no lora_B")
    folder = save_lora(base, tmp_path / "r", r=4, target_modules=["k_proj"])
    edit_config(folder, r=8)
    expect_error(folder, spec, "self_attn.k_proj", "rank 4", "says 8")


def test_untargeted_weights(base, spec, tmp_path):
    folder = save_lora(base, tmp_path, target_modules=["q_proj", "v_proj"])
    edit_config(folder, layers_to_transform=[0])
    expect_error(folder, spec, "model.layers.1.self_attn.q_proj", "does not target it")


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(use_dora=True), ["DoRA", "not supported"]),
        (dict(bias="all"), ["bias='all'", "not supported"]),
        (dict(modules_to_save=["lm_head"]), ["modules_to_save", "not supported"]),
        (dict(target_modules=["embed_tokens", "q_proj"]), ["module 'embed_tokens'", "not supported"]),
        (dict(target_modules=["q_proj", "lm_head"]), ["module 'lm_head'", "not supported"]),
        (dict(target_modules=r"(model\.embed_tokens|.*\.q_proj)"), ["module 'model.embed_tokens'", "not supported"]),
    ],
    ids=["dora", "bias_all", "modules_to_save", "embed_tokens", "lm_head", "embed_tokens_regex"],
)
def test_unsupported_features(base, spec, tmp_path, kwargs, fragments):
    folder = save_lora(base, tmp_path, **kwargs)
    expect_error(folder, spec, *fragments)


@pytest.mark.parametrize(
    "kwargs, hidden_key, fragments",
    [
        (dict(use_dora=True), "use_dora", ["DoRA", "lora_magnitude_vector", "not supported"]),
        (dict(modules_to_save=["lm_head"]), "modules_to_save", ["unexpected tensor", "lm_head", "not supported"]),
    ],
    ids=["dora", "modules_to_save"],
)
def test_unsupported_tensors_behind_a_clean_config(base, spec, tmp_path, kwargs, hidden_key, fragments):
    """The tensors alone reveal the feature even when the config no longer mentions it."""
    folder = save_lora(base, tmp_path, **kwargs)
    edit_config(folder, **{hidden_key: None})
    expect_error(folder, spec, *fragments)


def test_non_lora_peft_type(base, spec, tmp_path):
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    folder = save_peft(base, tmp_path, config)
    expect_error(folder, spec, "peft_type 'IA3'", "only LORA")


def test_base_model_name_mismatch_warns(base, tmp_path, caplog):
    folder = save_lora(base, tmp_path)
    edit_config(folder, base_model_name_or_path="acme/other-model")
    served = spec_of(base, model_name="acme/tiny-llama")
    with caplog.at_level(logging.WARNING):
        adapter = load_lora_adapter("w", folder, served, max_lora_rank=8)
    assert adapter.weights
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'w'" in warnings[0].getMessage() and "acme/other-model" in warnings[0].getMessage()
    caplog.clear()
    edit_config(folder, base_model_name_or_path="/models/Tiny-Llama/")
    with caplog.at_level(logging.WARNING):
        load_lora_adapter("w", folder, served, max_lora_rank=8)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    # a GGUF of the same model (its file and repo names carry the quantization): the same base
    edit_config(folder, base_model_name_or_path="acme/Tiny-Llama")
    for gguf_name in ("Tiny-Llama-Q4_K_M", "tiny-llama.Q8_0", "bartowski/Tiny-Llama-GGUF"):
        with caplog.at_level(logging.WARNING):
            load_lora_adapter("w", folder, spec_of(base, model_name=gguf_name), max_lora_rank=8)
        assert not [r for r in caplog.records if r.levelno == logging.WARNING], gguf_name
