"""What generation returns: one RequestOutput per prompt (cumulative, also while streaming)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence: text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None = None  # one dict per generated token
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """The state of one request after an engine step (texts are cumulative)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    lora_name: str | None = None
    error: str | None = None  # set when the request failed (for example its adapter broke)
    # with prompt_logprobs: per prompt token, its logprob and the top k given the tokens before it (None first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
