"""Reference outputs from HF transformers (+ PEFT): logprobs of every generated position, teacher-forced."""
from __future__ import annotations

import torch


def load_hf_model(model_dir: str, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device).eval()


def load_peft_model(model_dir: str, adapters: dict[str, str], dtype=torch.float32, device="cpu"):
    """The HF model of `model_dir` with PEFT adapters name -> folder loaded (run a batch with
    `adapter_names=[...]`, "__base__" for no adapter)."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(load_hf_model(model_dir, dtype, device), adapters[names[0]],
                                      adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.no_grad()
def teacher_forced_logprobs(hf_model, prompt_ids: list[int], generated_ids: list[int], **forward_kwargs) -> torch.Tensor:
    """[len(generated), V] fp32: HF's log-probabilities for each generated position given the tokens before it."""
    ids = torch.tensor([prompt_ids + generated_ids], device=hf_model.device)
    logits = hf_model(ids, **forward_kwargs).logits[0].float()  # [P + G, V]
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start:start + len(generated_ids)], dim=-1).cpu()


def is_greedy_of(tokens: list[int], ref_logprobs: torch.Tensor) -> bool:
    """Each token is a greedy choice of the reference ([len(tokens), V]): its logprob is the row's maximum
    (of several equal maxima, any)."""
    return all(float(ref_logprobs[i, t]) == float(ref_logprobs[i].max()) for i, t in enumerate(tokens))


def assert_matches_reference(output, ref_logprobs: torch.Tensor, atol: float = 1e-4) -> None:
    """Greedy tokens are HF's argmax at every position; every returned logprob is within atol of HF's."""
    tokens = output.outputs[0].token_ids
    assert len(tokens) == ref_logprobs.shape[0]
    for pos, (token, entry) in enumerate(zip(tokens, output.outputs[0].logprobs)):
        ref = ref_logprobs[pos]
        assert token == int(ref.argmax()), f"position {pos}: token {token}, HF argmax {int(ref.argmax())}"
        for tid, lp in entry.items():
            assert abs(lp - float(ref[tid])) <= atol, f"position {pos} token {tid}: {lp} vs HF {float(ref[tid])}"


@torch.no_grad()
def incremental_logprobs(hf_model, prompt_ids: list[int], generated_ids: list[int]) -> torch.Tensor:
    """[len(generated), V] fp32 as HF's generate computes them: the prompt in one pass, then one token per pass
    with the KV cache (for models whose forward depends on the pass, e.g. LongRoPE's factors)."""
    out = hf_model(torch.tensor([prompt_ids], device=hf_model.device), use_cache=True)
    rows = [out.logits[0, -1]]
    for token in generated_ids[:-1]:
        cache = out.get("cache") or out.get("past_key_values")
        out = hf_model(torch.tensor([[token]], device=hf_model.device), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1).cpu()
