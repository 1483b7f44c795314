"""The architectures beyond Llama (Mistral's window, Qwen3, Gemma 2, Gemma 3, Phi-3) against HF transformers on tiny
random models (CPU, fp32): prompts longer than the sliding window, alone, in mixed batches and in chunks; how each
config is read (windows per layer, rotary per layer type, LongRoPE); what is refused."""
import json
import random
import shutil
from types import SimpleNamespace

import pytest
import torch

from hf_reference import assert_matches_reference, incremental_logprobs, load_hf_model, teacher_forced_logprobs
from model_fixtures import LONGROPE_ORIGINAL, WINDOW
from loraserve import LLM, SamplingParams
from loraserve.errors import ModelLoadError
from loraserve.kernels import fused
from loraserve.kernels.attention import DecodeConfig, PrefillConfig, paged_decode_attention, paged_prefill_attention
from loraserve.models import attention as model_attention
from loraserve.models import ops
from loraserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from loraserve.models.llama import MistralForCausalLM, Qwen2ForCausalLM
from loraserve.models.loader import build_empty_model, open_model
from loraserve.models.registry import ARCHITECTURES
from loraserve.models.qwen3 import Qwen3ForCausalLM

NEW_ARCHS = ("mistral", "qwen3", "gemma2", "gemma3", "phi3")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


def _prompts(lengths, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_prompts_longer_than_the_window_match_hf_alone_mixed_and_chunked(arch, tiny_model_factory):
    folder = tiny_model_factory(arch)
    hf = load_hf_model(folder)
    long = _prompts([WINDOW + 7, 2 * WINDOW + 3, 61], hf.config.vocab_size, seed=1)
    short = _prompts([3, 11], hf.config.vocab_size, seed=2)
    llm = LLM(folder, device="cpu", max_model_len=128)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY)[0] for p in long]
    for prompt, out in zip(long, alone):
        assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))
    mixed = long + short
    batched = llm.generate([{"prompt_token_ids": p} for p in mixed], GREEDY)
    # chunks of 16 tokens: the window's edge falls inside chunks and between them
    chunked = LLM(folder, device="cpu", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    in_chunks = chunked.generate([{"prompt_token_ids": p} for p in mixed], GREEDY)
    for i, prompt in enumerate(mixed):
        ref = teacher_forced_logprobs(hf, prompt, batched[i].outputs[0].token_ids)
        assert_matches_reference(batched[i], ref)
        assert in_chunks[i].outputs[0].token_ids == batched[i].outputs[0].token_ids
        assert_matches_reference(in_chunks[i], ref)
    assert [o.outputs[0].token_ids for o in batched[:3]] == [o.outputs[0].token_ids for o in alone]


def _triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, softcap):
    """The CUDA path's attention kernels in place of the torch one (same arguments): decode for one query per
    sequence, prefill otherwise; small tiles, two decode splits."""
    out = torch.empty_like(q)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if bool((q_lens == 1).all()):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                               DecodeConfig(num_splits=2, block_n=16), window, softcap)
    else:
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, int(q_lens.max()),
                                scale, out, PrefillConfig(block_m=16, block_n=16), window, softcap)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_the_triton_kernels_in_each_decoder_match_hf(arch, tiny_model_factory, monkeypatch):
    """The kernels the CUDA path launches (Triton's interpreter here: fused norms, rotary with q/k norms, the
    activations, windowed and soft-capped paged attention), wired into the decoder as on CUDA, give HF's
    logprobs within 1e-4 on a prompt longer than the window and a short one."""
    folder = tiny_model_factory(arch)
    llm = LLM(folder, device="cpu", max_model_len=64)
    for name in ("rms_norm", "rotary_and_cache", "silu_and_mul", "gelu_tanh_and_mul"):
        monkeypatch.setattr(ops, f"{name}_ref", getattr(fused, name))
    monkeypatch.setattr(model_attention, "paged_attention_ref", _triton_attention)
    hf = load_hf_model(folder)
    prompts = _prompts([WINDOW + 10, 9], hf.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)):
        assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))


def test_phi3_longrope_matches_hf_generation_past_the_original_length(tiny_model_factory):
    """Prompts inside the original length (48), 32 tokens generated past it: the positions from 48 on take the
    long factors, as in HF's generate (one token per pass with the cache)."""
    folder = tiny_model_factory("phi3_longrope")
    hf = load_hf_model(folder)
    prompts = _prompts([30, LONGROPE_ORIGINAL - 1, 5], hf.config.vocab_size, seed=3)
    llm = LLM(folder, device="cpu", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs):
        assert_matches_reference(out, incremental_logprobs(hf, prompt, out.outputs[0].token_ids))
    cos_sin = llm.engine.runner.model.model.rotary_embeddings[0].cos_sin
    short_step = cos_sin[LONGROPE_ORIGINAL - 1, 0] - cos_sin[LONGROPE_ORIGINAL - 2, 0]
    assert not torch.isclose(cos_sin[LONGROPE_ORIGINAL, 0] - cos_sin[LONGROPE_ORIGINAL - 1, 0], short_step)


@pytest.mark.parametrize("arch", NEW_ARCHS + ("llama", "qwen2"))
def test_lora_modules_are_the_hf_models_linear_layers(arch, tiny_model_factory):
    """The registry's PEFT target names per architecture are the HF model's linear modules in its decoder layers,
    and the LoRA spec gives each its HF shape (Phi-3: qkv_proj and gate_up_proj, packed as in the checkpoint)."""
    folder = tiny_model_factory(arch)
    hf = load_hf_model(folder)
    linear = {name.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
              for name, m in hf.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    config = open_model(folder).hf_config
    model = build_empty_model(config, torch.device("cpu"), torch.float32)
    assert set(type(model).peft_target_modules()) == set(linear)
    assert model.lora_spec().modules == linear
    assert type(model) is ARCHITECTURES[config.architectures[0]]


def test_phi3_packed_checkpoint_tensors_load_into_their_slices(tiny_model_factory):
    folder = tiny_model_factory("phi3")
    hf = load_hf_model(folder)
    model = build_empty_model(open_model(folder).hf_config, torch.device("cpu"), torch.float32)
    from loraserve.models.loader import _iter_safetensors, _safetensors_files, load_weights

    load_weights(model, _iter_safetensors(_safetensors_files(folder)))
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        assert torch.equal(ours.self_attn.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
        assert torch.equal(ours.mlp.gate_up_proj.weight, theirs.mlp.gate_up_proj.weight)


def _config(**values):
    return SimpleNamespace(num_hidden_layers=values.pop("num_hidden_layers", 7), max_position_embeddings=512, **values)


def test_sliding_layers_from_configs_without_layer_types():
    """Configs written before transformers had `layer_types`: each architecture's own rule."""
    assert Gemma2ForCausalLM.sliding_windows(_config(sliding_window=64)) == [64, None] * 3 + [64]
    gemma3 = _config(sliding_window=64, sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
    layers = Gemma3ForCausalLM.layer_attention(gemma3)
    assert [a.window for a in layers] == [64, 64, None, 64, 64, None, 64]
    assert all((a.rope_theta, a.rope_scaling) == (1e4, None) for a in layers if a.window)
    assert all(a.rope_theta == 1e6 and a.rope_scaling["factor"] == 8.0 for a in layers if not a.window)
    qwen = _config(sliding_window=32, use_sliding_window=True, max_window_layers=5)
    assert Qwen3ForCausalLM.sliding_windows(qwen) == [None] * 5 + [32, 32]
    assert Qwen2ForCausalLM.sliding_windows(_config(sliding_window=32, use_sliding_window=False)) == [None] * 7
    assert MistralForCausalLM.sliding_windows(_config(sliding_window=4096)) == [4096] * 7
    assert MistralForCausalLM.sliding_windows(_config(sliding_window=None)) == [None] * 7
    given = _config(sliding_window=8, layer_types=["full_attention"] * 6 + ["sliding_attention"])
    assert Gemma2ForCausalLM.sliding_windows(given) == [None] * 6 + [8]


def test_gemma3_layers_share_one_rotary_table_per_layer_type(tiny_model_factory):
    llm = LLM(tiny_model_factory("gemma3"), device="cpu", max_model_len=64)
    model = llm.engine.runner.model
    tables = [layer.self_attn.attn.rotary for layer in model.model.layers]
    assert len(model.model.rotary_embeddings) == 2 and tables[0] is not tables[1]
    assert (tables[0].theta, tables[0].scaling) == (10000.0, None)
    assert tables[1].theta == 1e6 and tables[1].scaling["factor"] == 2.0


@pytest.mark.parametrize("arch,edit,problem", [
    ("phi3", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75), "partial_rotary_factor"),
    ("phi3", lambda c: c.update(partial_rotary_factor=0.75, rope_parameters=None), "partial_rotary_factor"),
    ("gemma3", lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("qwen3", lambda c: c.update(attention_bias=True), "attention_bias"),
    ("gemma2", lambda c: c.update(hidden_activation="relu"), "relu"),
])
def test_settings_not_served_are_refused_before_loading(arch, edit, problem, tiny_model_factory, tmp_path):
    folder = tmp_path / arch
    shutil.copytree(tiny_model_factory(arch), folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=problem):
        open_model(str(folder))
