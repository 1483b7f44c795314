"""Where an adapter folder may come from: the one rule for adapters named by a client.

An adapter is served from a folder only if its real path, and the real path of
every entry in it, lies inside the real path of a lora root (so neither `..`
nor a symlink leads out), and the folder holds `adapter_config.json` and
`adapter_model.safetensors` (pickled weights are never loaded from here).
`resolve_adapter_name` finds `<root>/<name>` for a request that names an
adapter; `resolve_adapter_path` checks a path given to the server's load
endpoint. Both return the folder's real path.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from loraserve.errors import InvalidRequestError, UnknownLoRAError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoRAPathOutsideRootError(InvalidRequestError):
    """An adapter name or path that leads out of every lora root (HTTP 400)."""


def is_inside(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies below it (both absolute and normalised, e.g. real paths)."""
    return os.path.commonpath([path, root]) == root


def _check_name(name: str) -> None:
    """A name that can only mean a folder below a root: relative, without empty, `.` or `..` parts."""
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("a LoRA adapter name must be a non-empty string")
    if "\0" in name:
        raise InvalidRequestError(f"LoRA adapter name {name!r} contains a NUL character")
    if os.path.isabs(name):
        raise LoRAPathOutsideRootError(f"LoRA adapter name {name!r} is an absolute path; "
                                       "name a folder inside the lora root")
    if any(part in ("", ".", "..") for part in name.replace(os.sep, "/").split("/")):
        raise LoRAPathOutsideRootError(f"LoRA adapter name {name!r} has an empty, '.' or '..' part; "
                                       "name a folder inside the lora root")


def resolve_adapter_name(name: str, root: str) -> str:
    """The real path of adapter folder `<root>/<name>`, checked (see the module docstring).

    UnknownLoRAError when there is no such folder; LoRAPathOutsideRootError when the name or a symlink
    leads out of the root; InvalidRequestError when the folder lacks an adapter file.
    """
    _check_name(name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if not is_inside(real, real_root) or real == real_root:
        where = "to the lora root itself" if real == real_root else "outside the lora root"
        raise LoRAPathOutsideRootError(f"LoRA adapter {name!r} resolves {where}")
    if not os.path.isdir(real):
        raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded and the lora root has no folder of that name")
    _check_folder(real, real_root, f"LoRA adapter {name!r}")
    return real


def resolve_adapter_path(path: str, roots: Sequence[str]) -> str:
    """The real path of adapter folder `path` (a relative path starts at the first root), which must lie
    inside one of `roots`, checked (see the module docstring). Every problem is an InvalidRequestError
    (LoRAPathOutsideRootError when the path leads out of every root)."""
    if not path:
        raise InvalidRequestError("lora_path must not be empty")
    if not roots:
        raise LoRAPathOutsideRootError("no lora root is configured: adapter paths are refused")
    if "\0" in path:
        raise InvalidRequestError(f"lora_path {path!r} contains a NUL character")
    real_roots = [os.path.realpath(r) for r in roots]
    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(real_roots[0], path))
    root = next((r for r in real_roots if is_inside(real, r)), None)
    if root is None:
        raise LoRAPathOutsideRootError(f"lora_path {path!r} resolves outside every lora root")
    if not os.path.isdir(real):
        raise InvalidRequestError(f"lora_path {path!r} is not a directory")
    _check_folder(real, root, f"lora_path {path!r}")
    return real


def _check_folder(real: str, root: str, what: str) -> None:
    """Every entry of folder `real` resolves inside `root`, and the adapter files are regular files."""
    try:
        entries = list(os.scandir(real))
    except OSError as exc:
        raise InvalidRequestError(f"{what} cannot be listed ({exc.strerror or type(exc).__name__})") from exc
    for entry in entries:
        if not is_inside(os.path.realpath(entry.path), root):
            raise LoRAPathOutsideRootError(f"{entry.name!r} in {what} links outside the lora root")
    for file in ADAPTER_FILES:
        if not os.path.isfile(os.path.join(real, file)):
            hint = (" (pickled weights such as adapter_model.bin are not loaded from a lora root)"
                     if file.endswith(".safetensors") else "")
            raise InvalidRequestError(f"{what} has no {file}{hint}")
