"""A request's state inside the engine: tokens, progress, KV blocks, detokenizer offsets."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loraserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request (one generated sequence).

    Each step computes tokens [num_computed_tokens, num_computed_tokens + n) of
    `all_token_ids`; when that reaches the end, a new token is sampled. A prompt
    is a prefill (maybe in chunks), a generated token a decode, and a request
    preempted by recompute simply starts again from num_computed_tokens = 0.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int  # order of arrival: first come, first served
    lora_name: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    # detokenizer state: text covers output tokens [0, read_offset); prefix_offset starts the decode window
    prefix_offset: int = 0
    read_offset: int = 0
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step needs one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
