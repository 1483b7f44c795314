"""Loading a PEFT LoRA adapter folder into validated tensors (in the file's dtype) and each B's scale.

`load_lora_adapter` reads adapter_config.json and adapter_model.safetensors (or
adapter_model.bin, through `torch.load(weights_only=True)` only), maps every
tensor to a (layer index, module short name) of the served model and checks it
against the model's shapes, `max_lora_rank` and the config, so that a bad
adapter fails loudly at load instead of serving wrong or base output. A module
the checkpoint packs (Phi-3's qkv_proj, gate_up_proj) is split into the slices
of the LoRA layer (`LoRAModelSpec.split`): the same A, each its rows of B.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import re
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from loraserve.lora.peft_config import (
    EMBEDDING_MODULES,
    LoRAAdapterError,
    PeftLoRAConfig,
    read_peft_lora_config,
)
from loraserve.models.lora_spec import LoRAModelSpec

__all__ = ["LoRAAdapter", "LoRAAdapterError", "load_lora_adapter"]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
# `<module>.lora_A.weight` or, with an adapter-name infix, `<module>.lora_A.<adapter>.weight`.
_LORA_WEIGHT = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight")
_LORA_BIAS = re.compile(r"(?P<module>.+)\.lora_B(?:\.[^.]+)?\.bias")
# A decoder-layer module: `...layers.<i>.<any path>.<short name>`.
_LAYER_MODULE = re.compile(r"(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?(?P<short>[^.]+)")


@dataclass
class LoRAAdapter:
    """A validated adapter: per (layer index, module short name) its A and B as read, and B's scale.

    The scale (PEFT's lora_alpha / r, or / sqrt(r)) is applied when the adapter is packed, in the same
    copy that casts B to the model's dtype (lora/pool.py), not by a pass of its own over B: the product is
    B * scale in float32, rounded once to the model's dtype, as scaling an upcast B first gives.
    """

    name: str
    path: str
    max_rank: int  # max rank over its modules
    # (layer, slice module) -> (A [r, in], B [out, r]); the slices of a packed module share one A
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # (layer, slice module) -> the scale of its B, where it is not 1
    scales: dict[tuple[int, str], float] = field(default_factory=dict)

    def scale_of(self, key: tuple[int, str]) -> float:
        return self.scales.get(key, 1.0)

    def nbytes(self) -> int:
        tensors = {id(t): t for pair in self.weights.values() for t in pair}  # a shared A once
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def to(self, device=None, dtype=None, pin_memory: bool = False) -> LoRAAdapter:
        """A new adapter with tensors moved/cast (and pinned, for CPU results); unchanged tensors are shared."""

        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device=device, dtype=dtype)
            if pin_memory:
                if t.device.type != "cpu":
                    raise ValueError(f"pin_memory needs CPU tensors, not {t.device}")
                t = t.pin_memory()
            return t

        moved: dict[int, torch.Tensor] = {}  # a shared A stays shared

        def move_once(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in moved:
                moved[id(t)] = move(t)
            return moved[id(t)]

        weights = {key: (move_once(a), move_once(b)) for key, (a, b) in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.max_rank, weights, dict(self.scales))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _read_tensors(name: str, folder: str) -> dict[str, torch.Tensor]:
    """The adapter's state dict from safetensors (preferred, like PEFT) or a weights-only .bin."""
    st_path, bin_path = os.path.join(folder, SAFETENSORS_FILE), os.path.join(folder, BIN_FILE)
    if os.path.isfile(st_path):
        try:
            tensors = load_file(st_path, device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise LoRAAdapterError(name, f"cannot read {SAFETENSORS_FILE} ({_first_line(exc)})") from exc
        source = SAFETENSORS_FILE
    elif os.path.isfile(bin_path):
        try:
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, EOFError, OSError, ValueError, RuntimeError) as exc:
            raise LoRAAdapterError(
                name, f"cannot read {BIN_FILE} with torch.load(weights_only=True) ({_first_line(exc)})"
            ) from exc
        source = BIN_FILE
    else:
        raise LoRAAdapterError(name, f"missing weights: neither {SAFETENSORS_FILE} nor {BIN_FILE} in {folder!r}")
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise LoRAAdapterError(name, f"{source} does not hold a dict of named tensors")
    if not tensors:
        raise LoRAAdapterError(name, f"{source} holds no tensors")
    return tensors


def _group_by_module(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Full module name (e.g. `model.layers.0.self_attn.q_proj`) -> {"A": tensor, "B": tensor}."""
    relative = {key: key.removeprefix(_PEFT_PREFIX) for key in sorted(tensors)}
    for rel in relative.values():  # unsupported features first: they explain any extra tensors
        if ".lora_embedding_" in rel:
            module = rel.split(".lora_embedding_")[0]
            raise LoRAAdapterError(name, "LoRA on embeddings is not supported yet", module)
        if ".lora_magnitude_vector" in rel:
            raise LoRAAdapterError(name, "DoRA (lora_magnitude_vector) is not supported yet", rel.split(".lora_")[0])
        if bias := _LORA_BIAS.fullmatch(rel):
            raise LoRAAdapterError(name, "LoRA bias is not supported yet", bias["module"])
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, rel in relative.items():
        match = _LORA_WEIGHT.fullmatch(rel)
        if match is None:
            raise LoRAAdapterError(
                name, f"unexpected tensor {key!r}: not a LoRA A/B weight (modules_to_save etc. are not supported)"
            )
        parts = modules.setdefault(match["module"], {})
        if match["part"] in parts:
            raise LoRAAdapterError(name, f"more than one lora_{match['part']} tensor", match["module"])
        parts[match["part"]] = tensors[key]
    return modules


def _locate(name: str, modules: list[str], spec: LoRAModelSpec) -> dict[str, tuple[int, str]]:
    """Full module name -> (layer index, short name); every module must exist in the model."""
    located, unmatched = {}, []
    for module in modules:
        short = module.rsplit(".", 1)[-1]
        if short in EMBEDDING_MODULES:
            raise LoRAAdapterError(name, f"LoRA on {short} (embedding/lm_head) is not supported yet", module)
        match = _LAYER_MODULE.fullmatch(module)
        if match is None or short not in spec.modules:
            unmatched.append(module)
        else:
            located[module] = (int(match["layer"]), short)
    supported = ", ".join(sorted(spec.modules))
    if not located:
        raise LoRAAdapterError(
            name,
            f"its tensors match no module of the model (they are for {', '.join(unmatched[:4])}"
            f"{', ...' if len(unmatched) > 4 else ''}; the model's LoRA modules are {supported} in layers.<i>)",
        )
    if unmatched:
        raise LoRAAdapterError(
            name, f"the model has no such LoRA module (its LoRA modules are {supported} in layers.<i>)", unmatched[0]
        )
    seen: dict[tuple[int, str], str] = {}
    for module, (layer, short) in located.items():
        if layer >= spec.num_layers:
            problem = f"layer {layer} does not exist (the model has {spec.num_layers} layers)"
            raise LoRAAdapterError(name, problem, module)
        if (layer, short) in seen:
            raise LoRAAdapterError(name, f"same layer and module as {seen[(layer, short)]!r}", module)
        seen[(layer, short)] = module
    return located


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of t is finite. NaN and +-Inf reach the extremes: one pass over the values, several
    times faster than isfinite(t).all(), and the two extremes checked as Python floats (an adapter has hundreds
    of small tensors: each op counts)."""
    return not t.numel() or all(map(math.isfinite, torch.stack(torch.aminmax(t)).tolist()))


def _check_tensor(name: str, module: str, which: str, t: torch.Tensor) -> torch.Tensor:
    """`t` (unchanged: the packer casts it to the model's dtype) after checking it is a finite 2-D floating-point
    matrix."""
    if not t.is_floating_point():
        raise LoRAAdapterError(name, f"{which} has dtype {t.dtype}, not a floating-point type", module)
    if t.dim() != 2:
        raise LoRAAdapterError(name, f"{which} has shape {tuple(t.shape)}, expected a matrix", module)
    if not all_finite(t):
        kind = "NaN" if torch.isnan(t).any() else "Inf"
        raise LoRAAdapterError(name, f"{which} contains {kind} values", module)
    return t


def _module_weights(
    name: str, module: str, parts: dict[str, torch.Tensor], dims: tuple[int, int],
    config: PeftLoRAConfig, max_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], B's scale) for one module, after every check; A and B in the file's dtype."""
    for part, other in (("A", "B"), ("B", "A")):
        if part not in parts:
            raise LoRAAdapterError(name, f"has lora_{other} but no lora_{part} weight", module)
    a = _check_tensor(name, module, "lora_A", parts["A"])  # [r, in]
    b = _check_tensor(name, module, "lora_B", parts["B"])  # [out, r]
    in_features, out_features = dims
    rank = a.shape[0]
    if a.shape[1] != in_features:
        raise LoRAAdapterError(
            name, f"lora_A has shape {tuple(a.shape)}, expected ({rank}, {in_features}) = (rank, in_features)", module
        )
    if b.shape != (out_features, rank):
        raise LoRAAdapterError(
            name, f"lora_B has shape {tuple(b.shape)}, expected ({out_features}, {rank}) = (out_features, rank)", module
        )
    if rank == 0:
        raise LoRAAdapterError(name, "rank is 0", module)
    if rank != config.rank_for(module):
        raise LoRAAdapterError(
            name, f"tensors have rank {rank} but adapter_config.json says {config.rank_for(module)}", module
        )
    if rank > max_lora_rank:
        raise LoRAAdapterError(name, f"rank {rank} exceeds max_lora_rank {max_lora_rank}", module)
    return a.contiguous(), b.contiguous(), config.scaling_for(module)


# What a GGUF file or repo adds to a model's name: `Qwen2.5-7B-Instruct-Q4_K_M.gguf`, `...-GGUF`, `....f16`.
_GGUF_SUFFIX = re.compile(r"(\.gguf|[-._](gguf|i?q\d\w*|b?f16|fp16|f32))+$")


def _model_stem(name_or_path: str) -> str:
    """`org/Model-7B`, `/models/model-7b/`, `Model-7B-Q4_K_M.gguf` -> `model-7b`: hub ids, local folders and
    GGUF files compare by their last part without the GGUF quantization suffix."""
    stem = name_or_path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    return _GGUF_SUFFIX.sub("", stem)


def _warn_base_mismatch(name: str, config: PeftLoRAConfig, spec: LoRAModelSpec) -> None:
    trained, served = config.base_model_name_or_path, spec.model_name
    if trained and served and _model_stem(trained) != _model_stem(served):
        logger.warning(
            "LoRA adapter '%s' was trained on base model %r but the served model is %r; outputs may be wrong",
            name, trained, served,
        )


def load_lora_adapter(name: str, path: str, spec: LoRAModelSpec, max_lora_rank: int) -> LoRAAdapter:
    """Load and validate the PEFT LoRA adapter in folder `path`; raises LoRAAdapterError if it can't be served."""
    if max_lora_rank <= 0:
        raise ValueError(f"max_lora_rank must be positive, got {max_lora_rank}")
    if not os.path.isdir(path):
        raise LoRAAdapterError(name, f"adapter path {path!r} is not a directory")
    config = read_peft_lora_config(name, path, spec.modules)
    _warn_base_mismatch(name, config, spec)
    grouped = _group_by_module(name, _read_tensors(name, path))
    located = _locate(name, list(grouped), spec)
    weights, scales = {}, {}
    for module, (layer, short) in sorted(located.items(), key=lambda item: item[1]):
        if not config.targets(module):
            raise LoRAAdapterError(
                name, "has weights but adapter_config.json (target_modules/layers_to_transform) does not target it",
                module,
            )
        a, b, scale = _module_weights(name, module, grouped[module], spec.modules[short], config, max_lora_rank)
        for slice_name, slice_a, slice_b in spec.split(short, a, b):
            weights[(layer, slice_name)] = (slice_a, slice_b.contiguous())
            if scale != 1:
                scales[(layer, slice_name)] = scale
    max_rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name=name, path=path, max_rank=max_rank, weights=weights, scales=scales)
