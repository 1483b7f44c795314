"""PEFT adapters of the architectures beyond Llama (Qwen3, Gemma 2, Gemma 3, Phi-3 with its packed qkv_proj and
gate_up_proj) against HF + PEFT (CPU, fp32): two adapters on every target module mixed with base rows, prompts
longer than the sliding window; adapters that target modules the architecture lacks are refused."""
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hf_reference import assert_matches_reference, load_peft_model, teacher_forced_logprobs
from model_fixtures import WINDOW, make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.adapter import LoRAAdapterError, load_lora_adapter
from loraserve.models.loader import build_empty_model, open_model

ARCHS = ("qwen3", "gemma2", "gemma3", "phi3")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


def _targets(folder) -> list[str]:
    return list(type(build_empty_model(open_model(folder).hf_config, torch.device("cpu"),
                                       torch.float32)).peft_target_modules())


@pytest.fixture(scope="module", params=ARCHS)
def arch_adapters(request, tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory(request.param)
    targets = _targets(folder)
    specs = [{"name": "r8", "r": 8, "lora_alpha": 16, "target_modules": targets},
             {"name": "r4_rslora", "r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": targets,
              "rank_pattern": {targets[-1]: 2}}]
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp(f"{request.param}-adapters"), specs, seed=4)
    return request.param, folder, dict(zip(["r8", "r4_rslora"], paths))


def test_two_adapters_on_every_module_mixed_with_base_rows_match_peft(arch_adapters):
    arch, folder, adapters = arch_adapters
    llm = LLM(folder, device="cpu", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    rng = random.Random(7)
    rows = [None, "r8", "r4_rslora", "r8", None, "r4_rslora"]
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(WINDOW + 1, 50))] for _ in rows]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=[LoRARequest(n, adapters[n]) if n else None for n in rows])
    peft = load_peft_model(folder, adapters)
    for name, prompt, out in zip(rows, prompts, outs):
        ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids, adapter_names=[name or "__base__"])
        assert_matches_reference(out, ref)
    # the adapters change the output: the same prompt under each gives other logprobs than base
    again = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, GREEDY,
                         lora_request=[LoRARequest("r8"), LoRARequest("r4_rslora")])
    for out in again:
        assert out.outputs[0].logprobs[0] != outs[0].outputs[0].logprobs[0]


def test_phi3_packed_adapter_modules_split_into_the_layer_slices(tiny_model_factory, tmp_path):
    """qkv_proj's one A serves the q, k and v slices and its B's rows split q | k | v (gate_up_proj: gate | up)."""
    folder = tiny_model_factory("phi3")
    path = make_lora_adapters(folder, tmp_path, [{"r": 4, "lora_alpha": 4, "target_modules": ["qkv_proj",
                                                                                             "gate_up_proj"]}])[0]
    spec = build_empty_model(open_model(folder).hf_config, torch.device("cpu"), torch.float32).lora_spec()
    adapter = load_lora_adapter("p", path, spec, max_lora_rank=8)
    tensors = load_file(f"{path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1"
    a = tensors[f"{prefix}.self_attn.qkv_proj.lora_A.weight"]
    b = tensors[f"{prefix}.self_attn.qkv_proj.lora_B.weight"]
    q, kv = 4 * 16, 2 * 16
    for name, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
        got_a, got_b = adapter.weights[(1, name)]
        assert torch.equal(got_a, a) and torch.equal(got_b, b[rows])
    gate_b = tensors[f"{prefix}.mlp.gate_up_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(1, "gate_proj")][1], gate_b[:128])
    assert torch.equal(adapter.weights[(1, "up_proj")][1], gate_b[128:])
    assert adapter.weights[(1, "gate_proj")][0] is adapter.weights[(1, "up_proj")][0]  # one A, held once
    assert adapter.nbytes() == sum(t.numel() * 4 for t in tensors.values())
    assert (1, "o_proj") not in adapter.weights


@pytest.mark.parametrize("arch,foreign", [("phi3", ["q_proj", "v_proj"]), ("gemma3", ["qkv_proj"]),
                                          ("qwen3", ["gate_up_proj", "q_norm"])])
def test_adapter_whose_targets_the_architecture_lacks_is_refused(arch, foreign, tiny_model_factory, tmp_path):
    """Target modules of another architecture's naming: refused at load, the message naming the module and the
    modules this one offers; nothing is served from it."""
    folder = tiny_model_factory(arch)
    donor = tiny_model_factory("qwen2" if arch == "phi3" else "phi3")  # an adapter written for other names
    path = make_lora_adapters(donor, tmp_path, [{"r": 4, "lora_alpha": 8, "target_modules": ["o_proj"]}])[0]
    config_file = f"{path}/adapter_config.json"
    config = json.loads(open(config_file).read())
    config["target_modules"] = foreign
    open(config_file, "w").write(json.dumps(config))
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=foreign[0]) as info:
        llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, LoRARequest("foreign", path))
    assert "o_proj" in str(info.value)  # the modules it does offer
    assert llm.list_loras() == []


def test_adapter_tensors_for_modules_the_architecture_lacks_are_refused(tiny_model_factory, tmp_path):
    """A Llama-family adapter (q_proj ... tensors) given to Phi-3 with a regex target: its tensors match no module."""
    donor = tiny_model_factory("qwen3")
    path = make_lora_adapters(donor, tmp_path, [{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}])[0]
    config_file = f"{path}/adapter_config.json"
    config = json.loads(open(config_file).read())
    config["target_modules"] = ".*proj"
    open(config_file, "w").write(json.dumps(config))
    target = tmp_path / "copy"
    shutil.copytree(path, target)
    llm = LLM(tiny_model_factory("phi3"), device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="q_proj.*qkv_proj|qkv_proj.*q_proj"):
        llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, LoRARequest("llama-names", str(target)))


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_default_random_adapters_cover_every_lora_layer(arch, tiny_model_factory):
    """The start-up graph check's probe adapters (lora.synthetic.random_adapter with its default targets) have a
    rank in every LoRA layer and every slice of the architecture, Phi-3's packed ones included."""
    from loraserve.lora.synthetic import random_adapter

    llm = LLM(tiny_model_factory(arch), device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    runtime = llm.engine.lora_manager.runtime
    adapter = random_adapter(runtime.spec, "probe", 8)
    assert torch.all(runtime.pack(adapter).ranks == 8)
    assert {(i, s) for i, layer in runtime.layers for s in layer.slice_names} == set(adapter.weights)
