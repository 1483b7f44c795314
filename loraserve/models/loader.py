"""Build a model on the meta device and fill it tensor by tensor from HF safetensors, a GGUF file,
or random weights (synthetic benchmarks models).

Two steps: `open_model` finds the model and reads its config (cheap: what the
engine's config needs, e.g. the model's length limits), `ModelSource.load`
builds the model on the device and reads the weights and the tokenizer.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.errors import ModelLoadError
from loraserve.models import gguf_loader
from loraserve.models.registry import model_class_for
from loraserve.models.synthetic import synthetic_config

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    name: str  # the default served model name
    generation_eos_ids: list[int]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty_model(hf_config, device: torch.device, dtype: torch.dtype,
                      tp: ParallelGroup = NO_PARALLEL) -> nn.Module:
    """The model (this rank's part of it) with uninitialised weights on `device` (built on meta, no host copy)."""
    cls = model_class_for(hf_config)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(hf_config, tp)
    model.to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], total: int | None = None) -> None:
    """Copy checkpoint tensors into the model's (packed) parameters; error on missing/unknown/mis-shaped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    # checkpoint module -> (packed module, slice index), from the model's packed_modules table
    packed_slices = {name: (packed, i) for packed, names in model.packed_modules.items()
                     for i, name in enumerate(names)}
    loaded: set[str] = set()
    for name, tensor in tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False,
                             disable=None):  # None: shown on a terminal only
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = name, None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in packed_slices:
            packed, shard = packed_slices[parts[-2]]
            target = ".".join(parts[:-2] + [packed, parts[-1]])
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of the model")
        owner = model.get_submodule(target.rpartition(".")[0])
        try:
            if hasattr(owner, "weight_loader"):
                owner.weight_loader(param, tensor, shard)
            else:
                _copy(param, tensor)
        except ValueError as exc:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from exc
        loaded.add(target)
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _copy(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ModelLoadError(f"model folder {path!r} is missing weight shards: {', '.join(missing)}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {path!r} has no *.safetensors weight files")
    return [os.path.join(path, f) for f in files]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"can't read weight file {file!r}: {exc}") from exc


def _count_tensors(files: list[str]) -> int | None:
    """Tensors in the safetensors files (their headers only), for the progress bar; None if unreadable (the
    load then names the file)."""
    try:
        total = 0
        for file in files:
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
        return total
    except (OSError, RuntimeError):
        return None


def _eos_ids(hf_config, tokenizer, path: str | None) -> list[int]:
    ids: list[int] = []
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if path and os.path.isfile(os.path.join(path, "generation_config.json")):
        with open(os.path.join(path, "generation_config.json")) as f:
            candidates.append(json.load(f).get("eos_token_id"))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for c in candidates:
        for i in (c if isinstance(c, list) else [c]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


@dataclass
class ModelSource:
    """A model found and its config read, weights not loaded yet."""

    model: str | None  # what the user gave: None (the default model), synthetic:NAME, a .gguf file, an HF
    # folder or a Hugging Face repo id
    hf_config: Any
    gguf_file: gguf_loader.GGUFModelFile | None = None  # the open GGUF file (its header read once)
    folder: str | None = None  # an HF model's folder (a repo id's snapshot in the local cache)

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 2048))

    def load(self, device: torch.device, dtype: torch.dtype, tokenizer_path: str | None = None,
             chat_template: str | None = None, tp: ParallelGroup = NO_PARALLEL) -> LoadedModel:
        """Build the model (rank tp.rank's part of it) on `device` in `dtype` and fill it; read the tokenizer
        (the model's own, or the HF tokenizer folder `tokenizer_path`), whose chat template `chat_template`
        replaces when given."""
        loaded = self._load(device, dtype, tokenizer_path, tp)
        if chat_template is not None:
            if loaded.tokenizer is None:
                raise ModelLoadError("a chat template was given but the model has no tokenizer (give --tokenizer)")
            loaded.tokenizer.chat_template = chat_template
        return loaded

    def load_model(self, device: torch.device, dtype: torch.dtype, tp: ParallelGroup = NO_PARALLEL) -> nn.Module:
        """The model (rank tp.rank's part of it) on `device` in `dtype`, its weights read (random for synthetic
        models: each rank draws its own, so only their speed is the same at every tensor-parallel size)."""
        net = build_empty_model(self.hf_config, device, dtype, tp)
        if self.model is not None and self.model.startswith("synthetic:"):
            randomize_weights(net, seed=0)
        elif self.gguf_file is not None:
            load_weights(net, self.gguf_file.weights(), total=len(self.gguf_file.reader.tensors))
        else:
            files = _safetensors_files(self.folder)
            load_weights(net, _iter_safetensors(files), total=_count_tensors(files))
        return net

    def _load(self, device: torch.device, dtype: torch.dtype, tokenizer_path: str | None,
              tp: ParallelGroup) -> LoadedModel:
        config, model = self.hf_config, self.model
        if tokenizer_path is not None and not os.path.isdir(tokenizer_path):
            raise ModelLoadError(f"tokenizer path {tokenizer_path!r} is not a folder (give an HF tokenizer folder)")
        net = self.load_model(device, dtype, tp)
        if model is not None and model.startswith("synthetic:"):
            if tokenizer_path is None:
                return LoadedModel(net, config, None, model, [])
            tokenizer = _load_tokenizer(tokenizer_path)
            return LoadedModel(net, config, tokenizer, model, _eos_ids(config, tokenizer, tokenizer_path))
        if self.gguf_file is not None:
            path = self.gguf_file.path
            if tokenizer_path is None:
                tokenizer = self.gguf_file.tokenizer()  # from the header read for the config: not parsed again
            else:
                tokenizer = _load_tokenizer(tokenizer_path)
            name = os.path.basename(path).split(".")[0] if model is None else os.path.basename(path)[:-5]
            return LoadedModel(net, config, tokenizer, name, _eos_ids(config, tokenizer, tokenizer_path))
        folder = self.folder
        tokenizer = _load_tokenizer(tokenizer_path or folder)
        name = model if folder != model else os.path.basename(os.path.normpath(folder))  # a repo id names itself
        return LoadedModel(net, config, tokenizer, name, _eos_ids(config, tokenizer, folder))


def open_model(model: str | None) -> ModelSource:
    """Resolve `model` (None = default GGUF, `synthetic:NAME`, a .gguf file or an HF folder) and read its config;
    ModelLoadError names what is wrong (path, files, architecture)."""
    if model is not None and model.startswith("synthetic:"):
        try:
            config = synthetic_config(model.split(":", 1)[1])
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        return ModelSource(model, config)
    if model is None or model.endswith(".gguf"):
        path = gguf_loader.default_model_path() if model is None else model
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file {path!r} does not exist")
        gguf_file = gguf_loader.GGUFModelFile.open(path)
        return ModelSource(model, gguf_file.config(), gguf_file)
    folder = model if os.path.isdir(model) else _cached_snapshot(model)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelLoadError(f"model folder {folder!r} has no config.json")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"can't read {folder}/config.json: {exc}") from exc
    model_class_for(config)  # unsupported architecture: fail before touching weights
    _safetensors_files(folder)  # missing weight files: fail before the engine is built
    return ModelSource(model, config, folder=folder)


def _cached_snapshot(model: str) -> str:
    """The folder of Hugging Face repo `model` (`org/name`) in the local cache (HF_HOME / HF_HUB_CACHE);
    ModelLoadError if it is not there (nothing is downloaded)."""
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(model, local_files_only=True)
        except LocalEntryNotFoundError:
            raise ModelLoadError(f"model {model!r} is not a local folder and not in the Hugging Face cache "
                                 f"({constants.HF_HUB_CACHE}); loraserve downloads nothing: fetch it first, e.g. "
                                 f"`huggingface-cli download {model}`") from None
    raise ModelLoadError(f"model path {model!r} does not exist (give an HF model folder, a Hugging Face repo id "
                         "in the local cache, a .gguf file or synthetic:NAME; no network downloads)")


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s): only token-id prompts can be served", path, exc)
        return None


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int) -> None:
    """Random weights (normal, std 0.02; norms near 1) for benchmarks: never zeros."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
