"""LoRARequest: which adapter a request wants, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and PEFT folder path.

    The path may be None for an adapter that is already registered with the
    engine (`LLM.add_lora`, `--lora-modules`).
    """

    name: str
    path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("LoRARequest.name must be a non-empty string")
