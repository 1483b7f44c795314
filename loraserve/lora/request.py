"""LoRARequest: which adapter a request wants, named as in vLLM."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and PEFT folder path.

    The path may be None for an adapter that is already registered with the
    engine (`LLM.add_lora`, `--lora-modules`) or that lies in the engine's
    `lora_root` as the folder `<lora_root>/<name>`.

    vLLM's positional form `LoRARequest(name, int_id[, path])` is accepted too:
    an int in second place is vLLM's adapter id, kept in `lora_int_id`
    (adapters are told apart by name here).
    """

    name: str
    path: str | None = None  # an os.PathLike is turned into a str, "" into None
    lora_int_id: int | None = field(default=None, compare=False)  # vLLM's id, not part of equality

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("LoRARequest.name must be a non-empty string")
        if _is_int(self.path):  # vLLM's LoRARequest(name, int_id, path): the id came second
            int_id, path = self.path, self.lora_int_id
            object.__setattr__(self, "path", path)
            object.__setattr__(self, "lora_int_id", int_id)
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.path == "":  # vLLM's default lora_path: no path
            object.__setattr__(self, "path", None)
        if self.path is not None and not isinstance(self.path, str):
            raise ValueError(f"LoRARequest.path must be a path or None, got {self.path!r}")
        if self.lora_int_id is not None and not _is_int(self.lora_int_id):
            raise ValueError(f"LoRARequest.lora_int_id must be an int or None, got {self.lora_int_id!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
