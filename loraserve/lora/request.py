"""LoRARequest: which adapter a request wants, named as in vLLM."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True, init=False)
class LoRARequest:
    """An adapter by name and PEFT folder path.

    The path may be None for an adapter that is already registered with the
    engine (`LLM.add_lora`, `--lora-modules`) or that lies in the engine's
    `lora_root` as the folder `<lora_root>/<name>`.

    vLLM's forms are accepted too: `LoRARequest(name, int_id[, path])` (an int in second place is vLLM's
    adapter id, kept in `lora_int_id`; adapters are told apart by name here) and the keywords
    `lora_name=`, `lora_int_id=`, `lora_path=`; `lora_name` and `lora_path` read `name` and `path`.
    """

    name: str
    path: str | None = None  # an os.PathLike is turned into a str, "" into None
    lora_int_id: int | None = field(default=None, compare=False)  # vLLM's id, not part of equality

    def __init__(self, name: str | None = None, path=None, lora_int_id=None, *, lora_name: str | None = None,
                 lora_path=None) -> None:
        if lora_name is not None:
            if name is not None:
                raise ValueError("give the adapter's name once (name or lora_name)")
            name = lora_name
        if lora_path is not None:
            if path is not None and not _is_int(path):
                raise ValueError("give the adapter's path once (path or lora_path)")
            if _is_int(path):  # LoRARequest(name, int_id, lora_path=...)
                path, lora_int_id = lora_path, path
            else:
                path = lora_path
        if not isinstance(name, str) or not name:
            raise ValueError("LoRARequest.name must be a non-empty string")
        if _is_int(path):  # vLLM's LoRARequest(name, int_id, path): the id came second
            path, lora_int_id = lora_int_id, path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if path == "":  # vLLM's default lora_path: no path
            path = None
        if path is not None and not isinstance(path, str):
            raise ValueError(f"LoRARequest.path must be a path or None, got {path!r}")
        if lora_int_id is not None and not _is_int(lora_int_id):
            raise ValueError(f"LoRARequest.lora_int_id must be an int or None, got {lora_int_id!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "lora_int_id", lora_int_id)

    @property
    def lora_name(self) -> str:
        return self.name

    @property
    def lora_path(self) -> str | None:
        return self.path


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
