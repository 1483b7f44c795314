"""Reading the settings of HF model configs as transformers 4.x and 5.x write them: rotary embedding, sliding
windows per layer, activation. ValueError names a setting loraserve does not serve."""
from __future__ import annotations

from loraserve.models.layers import LONGROPE, rope_type

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer types


def rope_settings(config, params: dict | None = None) -> tuple[float, dict | None]:
    """(rope theta, rope scaling dict or None); `params`: one layer type's rope parameters where the config
    holds several (Gemma 3 under transformers 5), else the config's own.

    LongRoPE's scaling gets the config's original and current position limits (transformers 4 keeps them
    beside the scaling dict)."""
    if params is None:
        params = getattr(config, "rope_parameters", None) or {}
        scaling = getattr(config, "rope_scaling", None) or params
        theta = getattr(config, "rope_theta", None) or params.get("rope_theta")
    else:
        scaling, theta = params, params.get("rope_theta")
    theta = float(theta or 10000.0)
    kind = rope_type(scaling)
    if kind == "default":
        return theta, None
    if kind in LONGROPE:
        scaling = dict(scaling, max_position_embeddings=config.max_position_embeddings)
        scaling.setdefault("original_max_position_embeddings",
                           getattr(config, "original_max_position_embeddings", None))
    return theta, dict(scaling)


def layer_types(config, default: list[str]) -> list[str]:
    """The config's `layer_types` (transformers 4.53+ and 5 write them), else `default` (the architecture's
    alternation rule for older configs)."""
    types = getattr(config, "layer_types", None) or default
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types {types!r}: need one of {SLIDING!r} / {FULL!r} per layer "
                         f"({config.num_hidden_layers})")
    return list(types)


def windows_of(config, types: list[str]) -> list[int | None]:
    """Per layer its sliding window (config.sliding_window) or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if SLIDING in types and not window:
        raise ValueError("the config has sliding-attention layers but no sliding_window")
    return [int(window) if kind == SLIDING else None for kind in types]


def same_window_everywhere(config) -> list[int | None]:
    """config.sliding_window (when set) in every layer (Mistral, Phi-3)."""
    kind = SLIDING if getattr(config, "sliding_window", None) else FULL
    return windows_of(config, [kind] * config.num_hidden_layers)


def activation(config, *names: str) -> str:
    """The MLP activation: "silu", or "gelu_tanh" (HF's gelu_pytorch_tanh), read from the first of `names`
    the config has."""
    act = next((getattr(config, n) for n in names if getattr(config, n, None)), "silu")
    known = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in known:
        raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(known)})")
    return known[act]
