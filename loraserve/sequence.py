"""The sequence and batch types that the scheduler makes and the model runner consumes: a request's state
inside the engine (tokens, progress, KV blocks, detokenizer offsets) and one scheduled step."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loraserve.sampling_params import SamplingParams


PENDING_TOKEN = -1  # a sampled token still on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request (one generated sequence).

    Each step computes tokens [num_computed_tokens, num_computed_tokens + n) of
    the prompt + output tokens; when that reaches the end, a new token is sampled. A prompt
    is a prefill (maybe in chunks), a generated token a decode, and a request
    preempted by recompute simply starts again from num_computed_tokens = 0.

    With asynchronous scheduling the token sampled by the step in flight is
    not known on the host yet: it counts in `num_pending_tokens` (it follows
    output_token_ids), reads as PENDING_TOKEN, and the model runner takes its
    value from the device when a step feeds it back to the model.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int  # order of arrival: first come, first served
    lora_name: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when it first ran (its queue time ends)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # one per prompt token, filled as computed
    text: str = ""
    # detokenizer state: text covers output tokens [0, read_offset); prefix_offset starts the decode window
    prefix_offset: int = 0
    read_offset: int = 0
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled by a step in flight, not yet on the host
    queued_at_step: int = 0  # the scheduler step at which it last entered the waiting queue

    def token_range(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output + pending tokens (PENDING_TOKEN for the pending ones)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        ids = self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - p):end - p]
        return ids + [PENDING_TOKEN] * (end - max(start, self.num_resolved_tokens))

    @property
    def num_resolved_tokens(self) -> int:
        """Prompt and output tokens known on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_resolved_tokens + self.num_pending_tokens

    def pending_token_ends_it(self, max_model_len: int) -> bool:
        """Whether the token in flight will end the sequence by its length (so it needs no further step)."""
        return self.num_pending_tokens > 0 and (
            len(self.output_token_ids) + self.num_pending_tokens >= self.sampling_params.max_tokens
            or self.num_tokens >= max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence and so samples a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step: what each scheduled sequence computes, and the sequences preempted to make room."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
