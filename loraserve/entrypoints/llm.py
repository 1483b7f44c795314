"""The offline API: LLM(...).generate(prompts) and LLM(...).chat(messages)."""
from __future__ import annotations

import itertools
import time
from dataclasses import replace

from tqdm import tqdm

from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams


class LLM:
    """A model ready to generate; `model=None` loads the built-in default (SmolLM2-135M-Instruct).

    Extra keyword options are the other fields of loraserve.config.EngineArgs (enable_lora, max_loras,
    max_lora_rank, max_cpu_loras, lora_root, block_size, max_num_batched_tokens, gpu_memory_utilization, ...).
    With `lora_root="/adapters"`, `LoRARequest("name")` for an adapter that is not registered loads the
    folder `/adapters/name` on first use (names that lead out of the folder are refused).
    """

    def __init__(self, model: str | None = None, *, device=None, dtype=None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enforce_eager: bool = False, seed: int = 0, **engine_options):
        self.engine = LLMEngine.from_args(EngineArgs(
            model=model, device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager, seed=seed, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt, in order.

        A prompt is a string or {"prompt_token_ids": [...]}; sampling_params and
        lora_request may be one for all prompts or a list with one per prompt. With
        sampling_params.n > 1 a prompt's RequestOutput holds n completions (index 0..n-1; with a seed,
        completion i samples with seed + i, as the server's choices do).
        use_tqdm: show a progress bar of finished prompts and token rates (on stderr).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), n, "sampling_params")
        loras = _per_prompt(lora_request, n, "lora_request")
        ids = [f"gen-{next(self._ids)}" for _ in range(n)]
        choices = {rid: [f"{rid}-{i}" for i in range(p.n)] if p.n > 1 else [rid] for rid, p in zip(ids, params)}
        self._register_new_loras(loras)
        added = []
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras):
                for i, choice in enumerate(choices[rid]):
                    seed = None if p.seed is None else p.seed + i
                    self.engine.add_request(choice, prompt, p if p.n == 1 else replace(p, n=1, seed=seed), lora)
                    added.append(choice)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, choices, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template (the
        tokenizer's, or `chat_template`)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": _as_ids(tokenizer.apply_chat_template(
            conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=True))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, lora_request, use_tqdm=use_tqdm)

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        self.engine.add_lora(lora_request, pinned)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def _register_new_loras(self, loras: list[LoRARequest | None]) -> None:
        """Register the adapters named that are not registered yet (from their path or the lora root) before any
        request is added: a broken one raises LoRAAdapterError here, as add_lora does. (The engine alone would
        read them in the background and fail their requests instead, which suits a loop that keeps stepping.)"""
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            if lora.name in self.engine.list_loras():
                continue
            path = self.engine.adapter_path(lora)
            if path is not None:
                self.engine.add_lora(LoRARequest(lora.name, path))

    def _run(self, ids: list[str], choices: dict[str, list[str]], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request's choices finished; one RequestOutput per request, its completions in
        choice order."""
        final: dict[str, RequestOutput] = {}
        owner = {choice: rid for rid in ids for choice in choices[rid]}
        pending = set(owner)
        left = {rid: len(choices[rid]) for rid in ids}
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", dynamic_ncols=True,
                  disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if not (out.finished and out.request_id in pending):
                        continue
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    rid = owner[out.request_id]
                    left[rid] -= 1
                    if left[rid] == 0:
                        prompt_tokens += len(out.prompt_token_ids)
                        bar.update(1)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"input: {prompt_tokens / elapsed:.1f} toks/s, "
                                        f"output: {output_tokens / elapsed:.1f} toks/s", refresh=False)
        return [_merged(rid, [final[c] for c in choices[rid]]) for rid in ids]


def _merged(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One request's output from its choices' (one each): their completions, indexed in order."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    completions = [replace(out.outputs[0], index=i) for i, out in enumerate(outs)]
    errors = [out.error for out in outs if out.error]
    return replace(first, request_id=request_id, outputs=completions, error=errors[0] if errors else None)


def _per_prompt(value, n: int, what: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _as_ids(encoded) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list, or a BatchEncoding in newer transformers."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])
