"""Turn the logits of a step's sampling rows into token ids (and logprobs when asked), without a host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-k, or None if not asked


class SampledTokens:
    """A step's samples, still on the device: `to_host()` waits for them (the only host sync of a step).

    tokens: [N] int64 device tensor; with logprobs asked, the sampled tokens' logprobs [N] and the top-k
    values and ids [N, k]. The copies to the host start at once (into pinned memory on CUDA), so
    `to_host()` only waits for the step to finish.
    """

    def __init__(self, tokens: torch.Tensor, want: list[int | None], logprob_tensors=None):
        self.tokens = tokens  # [N] int64, on the device: a later step may read them there
        self.want = want
        self._host = [t.to("cpu", non_blocking=True) if t.is_cuda else t
                      for t in (tokens, *(logprob_tensors or ()))]
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def to_host(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        token_list = self._host[0].tolist()
        n = len(token_list)
        if len(self._host) == 1:
            return SamplerOutput(token_list, [None] * n)
        sampled_lp, top_vals, top_ids = (t.tolist() for t in self._host[1:])
        out: list[dict[int, float] | None] = []
        for i in range(n):
            if self.want[i] is None:
                out.append(None)
                continue
            entry = {top_ids[i][j]: top_vals[i][j] for j in range(self.want[i])}
            entry[token_list[i]] = sampled_lp[i]
            out.append(entry)
        return SamplerOutput(token_list, out)


class Sampler:
    """Greedy, temperature, top-k, top-p; per-request seeds.

    A request with a seed owns a torch.Generator, so its samples do not depend on
    the other requests of the batch; the others share the engine's generator.
    Logprobs are those of the model's distribution (before temperature/top-k/top-p).
    Sampling is launched on the device without waiting for it (see SampledTokens).
    """

    def __init__(self, device: torch.device, seed: int):
        self.device = device
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

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> SampledTokens:
        # logits: [N, V] fp32
        n = logits.shape[0]
        greedy_rows = [i for i in range(n) if params[i].greedy]
        random_rows = [i for i in range(n) if not params[i].greedy]
        if not random_rows:
            tokens = logits.argmax(dim=-1)  # [N]
        elif not greedy_rows:
            tokens = self._sample(logits, request_ids, params)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            g = torch.tensor(greedy_rows, device=logits.device)
            r = torch.tensor(random_rows, device=logits.device)
            tokens[g] = logits[g].argmax(dim=-1)
            tokens[r] = self._sample(logits[r], [request_ids[i] for i in random_rows],
                                     [params[i] for i in random_rows])
        want = [p.logprobs for p in params]
        if not any(w is not None for w in want):
            return SampledTokens(tokens, want)
        logprobs = torch.log_softmax(logits, dim=-1)
        k = max(w or 0 for w in want)
        top_vals, top_ids = (logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long()))
        sampled_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [N]
        return SampledTokens(tokens, want, (sampled_lp, top_vals, top_ids))

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

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [R, V] -> probabilities after temperature, top-k and top-p
        temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
            k_t = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
            drop = ranks >= k_t
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            p_t = torch.tensor(top_ps, device=logits.device, dtype=sorted_probs.dtype).unsqueeze(1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= p_t  # keep the smallest prefix whose mass reaches top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)
