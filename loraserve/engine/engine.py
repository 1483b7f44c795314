"""LLMEngine: requests in, RequestOutputs out; `step()` = schedule -> run -> postprocess.

Asynchronous scheduling (the default): `step()` schedules and launches the
next step on the device before it reads the tokens of the step launched by the
previous call, so the host's scheduling, input preparation and output
processing overlap the device's work instead of leaving it idle. The next step
takes the tokens it needs from the device (Sequence.num_pending_tokens); a
sequence that the tokens read afterwards finish computed one token too many,
which is dropped. Outputs come one call later; greedy and seeded results are
the same as with `async_scheduling=False`.
"""
from __future__ import annotations

import itertools
import logging


from loraserve.config import CacheConfig, LoRAConfig, SchedulerConfig, resolve_device, resolve_dtype
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.detokenizer import append_new_text, find_stop_string
from loraserve.engine.request import Sequence
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.stats import EngineStats
from loraserve.errors import InvalidRequestError, PromptTooLongError, UnknownLoRAError
from loraserve.lora.adapter import LoRAAdapterError
from loraserve.lora.request import LoRARequest
from loraserve.models.llama import attention_window
from loraserve.models.loader import load_model
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """The synchronous engine. Not thread-safe: call it from one thread (AsyncLLMEngine does)."""

    def __init__(self, model: str | None = None, *, device=None, dtype=None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enforce_eager: bool = False, seed: int = 0, enable_lora: bool = False,
                 max_loras: int = 4, max_lora_rank: int = 64, max_cpu_loras: int = 16, block_size: int = 16,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 cpu_kv_cache_gb: float = 2.0, num_gpu_blocks_override: int | None = None,
                 async_scheduling: bool = True):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # settings that don't depend on the model are checked before the (slow) load
        self.cache_config = CacheConfig(block_size, gpu_memory_utilization, cpu_kv_cache_gb, num_gpu_blocks_override)
        self.lora_config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        loaded = load_model(model, self.device, self.dtype)
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.hf_config = loaded.hf_config
        self.eos_token_ids = set(loaded.generation_eos_ids)
        model_limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        if max_model_len is not None and max_model_len > model_limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_limit}")
        window = attention_window(self.hf_config)
        if window is not None:
            if max_model_len is not None and max_model_len > window:
                raise ValueError(f"max_model_len {max_model_len} exceeds the model's sliding attention window "
                                 f"{window}, which loraserve does not implement yet")
            model_limit = min(model_limit, window)
        self.max_model_len = max_model_len or min(model_limit, 8192)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048 if self.device.type == "cpu" else 8192, max_num_seqs)
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, self.max_model_len)
        self.lora_manager = None
        if self.lora_config is not None:
            self.lora_manager = self._make_lora_manager(loaded.model)
        self.runner = ModelRunner(loaded.model, self.device, self.dtype, self.cache_config,
                                  self.scheduler_config, seed, max_loras if enable_lora else 0, enforce_eager,
                                  self.lora_manager.layers if self.lora_manager else None)
        self.block_manager = BlockManager(self.runner.num_blocks, block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, max_loras,
                                   self.lora_manager.pinned if self.lora_manager else None)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.async_scheduling = async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read yet

    def _make_lora_manager(self, model):
        from loraserve.lora.adapter import LoRAModelSpec
        from loraserve.lora.layers import wrap_lora_layers
        from loraserve.lora.manager import LoRAManager

        cfg = self.hf_config
        layers = wrap_lora_layers(model, self.lora_config.max_loras, self.lora_config.max_lora_rank)
        attn = model.model.layers[0].self_attn
        d, q, kv, inter = cfg.hidden_size, attn.q_size, attn.kv_size, cfg.intermediate_size
        spec = LoRAModelSpec(
            num_layers=cfg.num_hidden_layers,
            modules={"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                     "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)},
            model_name=self.model_name)
        return LoRAManager(self.lora_config, layers, spec, self.device, self.dtype)

    # -- adapters -------------------------------------------------------------
    def _require_lora(self, what: str) -> None:
        if self.lora_manager is None:
            raise InvalidRequestError(f"{what} needs LoRA support: start the engine with enable_lora=True")

    def load_lora_weights(self, lora_request: LoRARequest):
        """Read and validate an adapter without touching engine state (safe on another thread);
        pass the result to add_lora(..., loaded=...)."""
        self._require_lora("load_lora_weights")
        if lora_request.path is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.name!r} has no path")
        return self.lora_manager.load(lora_request.name, lora_request.path)

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False, loaded=None) -> None:
        """Register an adapter (validated now; LoRAAdapterError names the problem)."""
        self._require_lora("add_lora")
        if lora_request.path is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.name!r} has no path")
        self.lora_manager.register(lora_request.name, lora_request.path, pinned, loaded)

    def remove_lora(self, name: str) -> None:
        self._require_lora("remove_lora")
        self.lora_manager.unregister(name)

    def list_loras(self) -> list[str]:
        return self.lora_manager.registered() if self.lora_manager else []

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        params = sampling_params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                                     "(the prompt and at least one generated token must fit)")
        lora_name = None
        if lora_request is not None:
            self._require_lora(f"request {request_id!r} asks for LoRA adapter {lora_request.name!r}, which")
            if lora_request.name not in self.lora_manager.paths:
                if lora_request.path is None:
                    raise UnknownLoRAError(f"LoRA adapter {lora_request.name!r} is not loaded")
                self.lora_manager.register(lora_request.name, lora_request.path)
            self.lora_manager.acquire(lora_request.name)
            lora_name = lora_request.name
        seq = Sequence(request_id, text, ids, params, next(self._arrivals), lora_name,
                       logprobs=[] if params.logprobs is not None else None)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: give prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.hf_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")
            del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.num_pending_tokens = 0  # a token still in flight for it is dropped when it arrives
        self.scheduler.finish(seq, reason)
        self.runner.sampler.forget(seq.request_id)
        if seq.lora_name is not None:
            self.lora_manager.release(seq.lora_name)

    # -- one step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then return the outputs of the step launched before it (with
        async_scheduling) or of this one (without)."""
        in_flight, self._in_flight = self._in_flight, None
        outputs = self._launch(self.scheduler.schedule(), in_flight)
        if in_flight is not None:
            outputs += self._read(in_flight)
        if not self.async_scheduling and self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            outputs += self._read(launched)
        return outputs

    def _launch(self, out, in_flight: LaunchedStep | None) -> list[RequestOutput]:
        """Start `out` on the device (kept in self._in_flight); returns the outputs of requests failed on
        the way (a broken adapter)."""
        if out.is_empty:
            return []
        lora_slots: dict[str, int] = {}
        if self.lora_manager is not None:
            names = {s.seq.lora_name for s in out.scheduled if s.seq.lora_name is not None}
            try:
                lora_slots = self.lora_manager.prepare_slots(names, self.scheduler.running_loras())
            except LoRAAdapterError as exc:
                return self._fail_adapter(exc)
        self._in_flight = self.runner.execute(out, lora_slots, in_flight)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq in self._in_flight.sequences:
            seq.num_pending_tokens += 1
        return []

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to their sequences."""
        if launched.samples is None:
            return []
        result = launched.samples.to_host()
        outputs = []
        for seq, token, logprobs in zip(launched.sequences, result.token_ids, result.logprobs):
            if seq.is_finished:
                continue  # finished (or aborted) while this step was in flight: the token is dropped
            seq.num_pending_tokens -= 1
            self._append_token(seq, token, logprobs)
            outputs.append(self._make_output(seq))
            if seq.is_finished:
                del self._requests[seq.request_id]
        return outputs

    def _fail_adapter(self, exc: LoRAAdapterError) -> list[RequestOutput]:
        """An adapter broke after registration (its files changed while it was out of the caches):
        finish its requests with the error, unregister it, and leave every other request running.
        The step's other sequences keep their blocks and run in the next step."""
        logger.error("%s; its requests fail, the engine goes on", exc)
        failed = [seq for seq in self._requests.values() if seq.lora_name == exc.adapter]
        outputs = []
        for seq in failed:
            seq.error = str(exc)
            self._finish(seq, "abort")
            outputs.append(self._make_output(seq))
            del self._requests[seq.request_id]
        if exc.adapter in self.lora_manager.paths:
            self.lora_manager.unregister(exc.adapter)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        params = seq.sampling_params
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        new_len = len(append_new_text(self.tokenizer, seq)) if self.tokenizer is not None else 0
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.stop_reason = None
            self._finish(seq, "stop")
        elif token in params.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, "stop")
        elif (stop := find_stop_string(seq, new_len)) is not None:
            seq.stop_reason = stop
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_resolved_tokens >= self.max_model_len:
            self._finish(seq, "length")

    @staticmethod
    def _make_output(seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(0, seq.text, list(seq.output_token_ids), seq.finish_reason,
                                      list(seq.logprobs) if seq.logprobs is not None else None, seq.stop_reason)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished,
                             seq.lora_name, seq.error)

    def stats(self) -> EngineStats:
        mgr = self.lora_manager
        load_seconds = []
        if mgr is not None:
            load_seconds, mgr.load_seconds = mgr.load_seconds, []
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.block_manager.num_blocks, kv_blocks_used=self.block_manager.num_used_blocks,
            lora_slots_total=self.lora_config.max_loras if self.lora_config else 0,
            lora_slots_used=mgr.num_slots_used if mgr else 0,
            loras_on_gpu=mgr.resident_on_gpu if mgr else [], loras_on_cpu=mgr.resident_on_cpu if mgr else [],
            lora_refcounts=dict(mgr.refcounts) if mgr else {}, lora_load_seconds=load_seconds)
