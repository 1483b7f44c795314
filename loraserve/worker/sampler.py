"""Turn the logits of a step's sampling rows into token ids (and logprobs when asked), without a host sync."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loraserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-k, or None if not asked


Wait = Callable[[torch.cuda.Event], None]  # how the host waits for a device event (default: synchronize)


class _HostCopies:
    """Device tensors on their way to the host: the copies start at once (non-blocking), `lists()` waits for
    them (with the step) and returns them as Python lists."""

    def __init__(self, tensors):
        self._host = [t.to("cpu", non_blocking=True) if t.is_cuda else t for t in tensors]
        self._ready = None
        if any(t.is_cuda for t in tensors):
            self._ready = torch.cuda.Event()
            self._ready.record()

    def lists(self, wait: Wait | None = None) -> list[list]:
        if self._ready is not None:
            (wait or torch.cuda.Event.synchronize)(self._ready)
        return [t.tolist() for t in self._host]


class SampledTokens:
    """A step's samples, still on the device: `to_host()` waits for them (the only host sync of a step).

    tokens: [N] int64 device tensor; with logprobs asked, the sampled tokens' logprobs [N] and the top-k
    values and ids [N, k]. The copies to the host start at once (into pinned memory on CUDA), so
    `to_host()` only waits for the step to finish.
    """

    def __init__(self, tokens: torch.Tensor, want: list[int | None], logprob_tensors=None):
        self.tokens = tokens  # [N] int64, on the device: a later step may read them there
        self.want = want
        self._copies = _HostCopies((tokens, *(logprob_tensors or ())))

    def to_host(self, wait: Wait | None = None) -> SamplerOutput:
        token_list, *logprob_lists = self._copies.lists(wait)
        n = len(token_list)
        if not logprob_lists:
            return SamplerOutput(token_list, [None] * n)
        sampled_lp, top_vals, top_ids = logprob_lists
        out: list[dict[int, float] | None] = []
        for i in range(n):
            if self.want[i] is None:
                out.append(None)
                continue
            entry = {top_ids[i][j]: top_vals[i][j] for j in range(self.want[i])}
            entry[token_list[i]] = sampled_lp[i]
            out.append(entry)
        return SamplerOutput(token_list, out)


class PromptLogprobs:
    """Logprobs of prompt tokens, still on the device: `to_host()` waits for them (with the step's samples).

    Per row: the logprob of the token that follows (`targets`) and the top `num_top[row]` of the model's
    distribution there; copies to the host start at once (pinned memory on CUDA)."""

    def __init__(self, logits: torch.Tensor, targets: list[int], num_top: list[int]):
        # logits: [R, V] fp32
        logprobs = torch.log_softmax(logits, dim=-1)
        target_t = torch.tensor(targets, dtype=torch.long)
        if logits.is_cuda:
            target_t = target_t.pin_memory().to(logits.device, non_blocking=True)
        k = max(num_top)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
        chosen = logprobs.gather(1, target_t.unsqueeze(1)).squeeze(1)  # [R]
        self.targets, self.num_top = targets, num_top
        self._copies = _HostCopies((chosen, top_vals, top_ids))

    def to_host(self, wait: Wait | None = None) -> list[dict[int, float]]:
        chosen, top_vals, top_ids = self._copies.lists(wait)
        out = []
        for i, target in enumerate(self.targets):
            entry = {top_ids[i][j]: top_vals[i][j] for j in range(self.num_top[i])}
            entry[target] = chosen[i]
            out.append(entry)
        return out


@dataclass
class TokenHistory:
    """The tokens each sampling row's request has seen, for the penalties: prompt and generated ids known on
    the host, and where the one generated token still in flight sits in that step's samples (on the device)."""

    prompt_ids: list[list[int]]  # per row
    output_ids: list[list[int]]  # per row, without the token in flight
    pending: list[int | None]  # per row: index into in_flight_tokens of its newest token, or None
    in_flight_tokens: torch.Tensor | None  # [M] int64 on the device: the samples of the step in flight


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p; logit bias; min_tokens; per-request seeds.

    A request with a seed owns a torch.Generator, so its samples do not depend on
    the other requests of the batch; the others share the engine's generator.
    Before anything else the logits get each request's logit_bias, and a request that has generated fewer
    than min_tokens tokens cannot sample EOS (the model's, unless ignore_eos) or its stop_token_ids. Then
    the penalties, as vLLM applies them: presence and frequency (OpenAI's) over the generated tokens,
    repetition (HF's: positive logits divided, negative ones multiplied) over prompt and generated tokens,
    the token still in flight read on the device (TokenHistory). Then greedy rows take the argmax; the others apply temperature, top-k, top-p and min-p, in that order, and
    sample. Logprobs are those of the model's distribution (before all of that). Every per-row setting
    reaches the device by a non-blocking copy from pinned memory: sampling is launched without waiting for
    the step (see SampledTokens).
    """

    def __init__(self, device: torch.device, seed: int, eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.device = device
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[request_id] = gen
        return gen

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list on the device without a sync (pinned memory, non-blocking copy)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                 num_generated: list[int] | None = None, history: TokenHistory | None = None) -> SampledTokens:
        # logits: [N, V] fp32; num_generated: per row, the tokens its request has generated so far; history:
        # needed when a row has a penalty
        n = logits.shape[0]
        raw = logits
        logits = self._biased_and_masked(logits, params, num_generated or [0] * n)
        if any(p.has_penalties for p in params):
            if history is None:
                raise ValueError("penalties need the rows' token history")
            logits = self._penalized(logits, params, history)
        greedy_rows = [i for i in range(n) if params[i].greedy]
        random_rows = [i for i in range(n) if not params[i].greedy]
        if not random_rows:
            tokens = logits.argmax(dim=-1)  # [N]
        elif not greedy_rows:
            tokens = self._sample(logits, request_ids, params)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            g = self._to_device(greedy_rows, torch.long)
            r = self._to_device(random_rows, torch.long)
            tokens[g] = logits[g].argmax(dim=-1)
            tokens[r] = self._sample(logits[r], [request_ids[i] for i in random_rows],
                                     [params[i] for i in random_rows])
        want = [p.logprobs for p in params]
        if not any(w is not None for w in want):
            return SampledTokens(tokens, want)
        logprobs = torch.log_softmax(raw, dim=-1)
        k = max(w or 0 for w in want)
        top_vals, top_ids = (logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long()))
        sampled_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [N]
        return SampledTokens(tokens, want, (sampled_lp, top_vals, top_ids))

    def _biased_and_masked(self, logits: torch.Tensor, params: list[SamplingParams],
                           num_generated: list[int]) -> torch.Tensor:
        """logits [N, V] plus each row's logit_bias, with EOS and stop tokens at -inf in rows that have not
        reached min_tokens (a new tensor when anything changes)."""
        vocab = logits.shape[1]
        rows, cols, values = [], [], []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                if token < vocab:
                    rows.append(i), cols.append(token), values.append(bias)
            if num_generated[i] < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                for token in sorted(t for t in banned if t < vocab):
                    rows.append(i), cols.append(token), values.append(float("-inf"))
        if not rows:
            return logits
        index = (self._to_device(rows, torch.long), self._to_device(cols, torch.long))
        return logits.index_put(index, self._to_device(values, logits.dtype), accumulate=True)

    def _counts(self, rows: list[list[int]], pending: list[int | None] | None, in_flight: torch.Tensor | None,
                vocab: int) -> torch.Tensor:
        """[R, V] float: how often each token occurs in each row's ids (and its token in flight)."""
        width = max([len(r) for r in rows] + [0]) + (1 if pending is not None else 0)
        padded = [r + [vocab] * (width - len(r)) for r in rows]  # id `vocab`: padding, dropped below
        ids = self._to_device(padded, torch.long).view(len(rows), width)  # [R, W]
        if pending is not None and any(p is not None for p in pending):
            sources = self._to_device([-1 if p is None else p for p in pending], torch.long)  # [R]
            newest = torch.where(sources >= 0, in_flight[sources.clamp(min=0)], vocab)
            ids[:, -1] = newest
        counts = torch.zeros(len(rows), vocab + 1, device=ids.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, :vocab]

    def _penalized(self, logits: torch.Tensor, params: list[SamplingParams], history: TokenHistory) -> torch.Tensor:
        """logits [N, V] with each row's presence, frequency and repetition penalties (a new tensor)."""
        vocab = logits.shape[1]
        output = self._counts(history.output_ids, history.pending, history.in_flight_tokens, vocab)  # [N, V]
        presence = self._to_device([p.presence_penalty for p in params], logits.dtype).unsqueeze(1)
        frequency = self._to_device([p.frequency_penalty for p in params], logits.dtype).unsqueeze(1)
        logits = logits - frequency * output - presence * (output > 0).to(logits.dtype)
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            seen = (self._counts(history.prompt_ids, None, None, vocab) + output) > 0
            r = self._to_device(repetition, logits.dtype).unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        return logits

    def _sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; each row's E from its generator."""
        probs = self._filtered_probs(logits, params)  # [R, V]
        noise = torch.empty_like(probs)
        if all(p.seed is None for p in params):
            noise.exponential_(generator=self.generator)
        else:
            for j, (rid, p) in enumerate(zip(request_ids, params)):
                noise[j].exponential_(generator=self._generator_for(rid, p))
        return (probs / noise).argmax(dim=-1)

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [R, V] -> probabilities after temperature, top-k, top-p and min-p (not renormalized after
        # min-p: the exponential race needs only their ratios)
        temps = self._to_device([p.temperature for p in params], logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
            k_t = self._to_device(top_ks, torch.long).unsqueeze(1)
            drop = ranks >= k_t
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            p_t = self._to_device(top_ps, sorted_probs.dtype).unsqueeze(1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= p_t  # keep the smallest prefix whose mass reaches top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            floor = probs.amax(dim=-1, keepdim=True) * self._to_device(min_ps, probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs
