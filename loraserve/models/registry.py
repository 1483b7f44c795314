"""Architecture name (config.json `architectures`) -> model class; each class's PEFT target modules are its
`peft_target_modules()` and its packed layers its `packed_modules` (and `checkpoint_packed`)."""
from __future__ import annotations

from torch import nn

from loraserve.errors import ModelLoadError
from loraserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from loraserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from loraserve.models.phi3 import Phi3ForCausalLM
from loraserve.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def model_class_for(config) -> type[nn.Module]:
    """The class of the config's architecture, after checking that it serves the config's settings."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            cls = ARCHITECTURES[name]
            try:
                cls.check_config(config)
            except ValueError as exc:
                raise ModelLoadError(f"{name}: {exc}") from exc
            return cls
    raise ModelLoadError(
        f"unsupported model architecture {names or '(none given)'}; supported: {', '.join(ARCHITECTURES)}")
