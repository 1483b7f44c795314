"""Reading and checking a PEFT LoRA `adapter_config.json`.

Parses the fields that decide a LoRA adapter's arithmetic (rank, alpha, rsLoRA,
per-module rank/alpha patterns) and which modules it claims (target_modules,
exclude_modules, layers_to_transform, layers_pattern), and rejects the PEFT
features loraserve does not serve. Module names are the full names inside the
base model, e.g. `model.layers.3.self_attn.q_proj`, matched the way PEFT does.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head"})

# Config keys whose truthy value asks for a feature loraserve does not serve.
_UNSUPPORTED_FEATURES = (
    ("use_dora", "DoRA (use_dora)"),
    ("lora_bias", "LoRA bias (lora_bias)"),
    ("modules_to_save", "modules_to_save (fully trained extra modules)"),
    ("target_parameters", "target_parameters (LoRA on raw parameters)"),
    ("trainable_token_indices", "trainable_token_indices (trainable embedding rows)"),
    ("layer_replication", "layer_replication"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("fan_in_fan_out", "fan_in_fan_out=true (transposed Conv1D weights)"),
)


class LoRAAdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message names adapter, module and problem."""

    def __init__(self, adapter: str, problem: str, module: str | None = None):
        where = f"module '{module}': " if module else ""
        super().__init__(f"LoRA adapter '{adapter}': {where}{problem}")
        self.adapter = adapter
        self.module = module
        self.problem = problem


def _short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _matches_names(names: tuple[str, ...] | str, module: str) -> bool:
    """PEFT's target/exclude rule: a string is a regex for the full name, a list holds suffixes."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == n or module.endswith("." + n) for n in names)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches a dotted suffix."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The parts of a PEFT LoraConfig that loraserve uses."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str   # suffix list, or a regex for the full module name
    exclude_modules: tuple[str, ...] | str
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    base_model_name_or_path: str | None

    def targets(self, module: str) -> bool:
        """Whether PEFT would have put a LoRA on `module` (a full module name)."""
        if self.exclude_modules and _matches_names(self.exclude_modules, module):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not _matches_names(self.target_modules, module):
            return False
        if self.layers_to_transform is None:
            return True
        if self.layers_pattern:
            found = (re.match(rf"(?:^|.*?\.){p}\.(\d+)\.", module) for p in self.layers_pattern)
            match = next((m for m in found if m), None)
        else:
            match = re.match(r".*?\.[^.]*\.(\d+)\.", module)
        return match is not None and int(match.group(1)) in self.layers_to_transform

    def rank_for(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.r)

    def scaling_for(self, module: str) -> float:
        """The factor PEFT multiplies the LoRA output with: alpha/r, or alpha/sqrt(r) for rsLoRA."""
        rank = self.rank_for(module)
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _str_list(adapter: str, raw: dict, key: str) -> tuple[str, ...] | str:
    """A field that is a regex string or a list of names; None/absent gives ()."""
    value = raw.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as exc:
            raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: {key} {value!r} is not a valid regex ({exc})") from exc
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: {key} must be a string or a list of strings, got {value!r}")


def _pattern(adapter: str, raw: dict, key: str, check, what: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: {key} must be an object, got {value!r}")
    for pattern, item in value.items():
        if not check(item):
            raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: {key}[{pattern!r}] must be {what}, got {item!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: {key} key {pattern!r} is not a valid regex") from exc
    return dict(value)


def _layers(adapter: str, raw: dict) -> tuple[int, ...] | None:
    value = raw.get("layers_to_transform")
    if value is None or value == []:
        return None
    if _is_int(value):
        return (value,)
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return tuple(value)
    raise LoRAAdapterError(
        adapter, f"{CONFIG_FILE}: layers_to_transform must be an int or a list of ints, got {value!r}"
    )


def _read_json(adapter: str, folder: str) -> dict:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise LoRAAdapterError(adapter, f"missing {CONFIG_FILE} in {folder!r}")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE} is too large ({size} bytes; the limit is 1 MiB)")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(MAX_CONFIG_BYTES + 1))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _check_supported(adapter: str, raw: dict, model_modules) -> None:
    peft_type = raw.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise LoRAAdapterError(adapter, f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    for key, feature in _UNSUPPORTED_FEATURES:
        if raw.get(key):
            raise LoRAAdapterError(adapter, f"{feature} is not supported yet")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(adapter, f"bias={bias!r} (trained biases) is not supported yet; only bias='none' is")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str):
                continue
            short = _short_name(target)
            if short in EMBEDDING_MODULES:
                raise LoRAAdapterError(adapter, f"LoRA on {short} (embedding/lm_head) is not supported yet", target)
            if short not in model_modules:
                raise LoRAAdapterError(
                    adapter,
                    f"target module {target!r} does not exist in the model "
                    f"(its LoRA modules: {', '.join(sorted(model_modules))})",
                    target,
                )


def read_peft_lora_config(adapter: str, folder: str, model_modules) -> PeftLoRAConfig:
    """Read `folder/adapter_config.json`; `model_modules` are the short names the model offers LoRA."""
    raw = _read_json(adapter, folder)
    _check_supported(adapter, raw, model_modules)
    r, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not _is_int(r) or r <= 0:
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if not _is_number(alpha):
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE}: use_rslora must be true or false, got {use_rslora!r}")
    targets = _str_list(adapter, raw, "target_modules")
    if not targets:
        raise LoRAAdapterError(adapter, f"{CONFIG_FILE} names no target_modules")
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = tuple(model_modules)
    base = raw.get("base_model_name_or_path")
    layers_pattern = _str_list(adapter, raw, "layers_pattern")
    return PeftLoRAConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=_pattern(adapter, raw, "rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer"),
        alpha_pattern=_pattern(adapter, raw, "alpha_pattern", _is_number, "a finite number"),
        target_modules=targets,
        exclude_modules=_str_list(adapter, raw, "exclude_modules"),
        layers_to_transform=_layers(adapter, raw),
        layers_pattern=(layers_pattern,) if isinstance(layers_pattern, str) else layers_pattern,
        base_model_name_or_path=base if isinstance(base, str) and base else None,
    )
