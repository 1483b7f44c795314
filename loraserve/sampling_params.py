"""Per-request sampling settings, validated when they are made."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and meanings).

    temperature 0 means greedy; top_k 0 (or -1) means no top-k cut; min_p drops tokens less likely than
    min_p times the most likely one; logit_bias adds to the logits of token ids before anything else
    (greedy too). presence_penalty and frequency_penalty (OpenAI's, in [-2, 2]) lower the logits of tokens
    already generated, once and per occurrence; repetition_penalty (> 0, 1 = off) divides the positive logits
    and multiplies the negative ones of tokens in the prompt or generated. logprobs=k returns, per generated token, the sampled token's logprob and the top k (of the
    model's own distribution); prompt_logprobs=k the same for each prompt token after the first. min_tokens: EOS and stop_token_ids can't end (nor be sampled in) the first
    min_tokens tokens. n: that many completions of the prompt (LLM.generate; with a seed, completion i uses
    seed + i). skip_special_tokens: leave special tokens out of the text; include_stop_str_in_output: keep
    the stop string that ended the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < float(self.repetition_penalty) <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        bias = dict(self.logit_bias or {})
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in bias) or \
                any(isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0
                    for v in bias.values()):
            raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {self.logit_bias!r}")
        self.logit_bias = {t: float(v) for t, v in bias.items()} or None
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise ValueError(f"{name} must be an integer in [0, 20], got {value!r}")
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
