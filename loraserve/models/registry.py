"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from loraserve.errors import ModelLoadError
from loraserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class_for(config) -> type[nn.Module]:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ModelLoadError(
        f"unsupported model architecture {names or '(none given)'}; supported: {', '.join(ARCHITECTURES)}")
