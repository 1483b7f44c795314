"""LLMEngine: requests in, RequestOutputs out; `step()` = schedule -> run -> postprocess.

Asynchronous scheduling (the default): `step()` schedules and launches the
next step on the device before it reads the tokens of the step launched by the
previous call, so the host's scheduling, input preparation and output
processing overlap the device's work instead of leaving it idle. The next step
takes the tokens it needs from the device (Sequence.num_pending_tokens); a
sequence that the tokens read afterwards finish computed one token too many,
which is dropped. Outputs come one call later; greedy and seeded results are
the same as with `async_scheduling=False`.

With `tensor_parallel_size` N > 1 the engine's process is rank 0: it holds the
scheduler, the block manager, the LoRA manager and its own part of the model;
ranks 1..N-1 run in worker processes (loraserve.worker.processes) that follow
its steps. A worker that dies, or a step that fails on rank 0 (the ranks are
out of step then), makes every later call of `step` raise EngineDeadError
(WorkerDiedError names the worker); `shutdown` stops the workers, which also
happens when the engine is garbage-collected or the interpreter exits.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import replace

from loraserve.config import EngineArgs, EngineConfig
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.detokenizer import append_new_text, find_stop_string
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.stats import EngineStats
from loraserve.distributed import NO_PARALLEL
from loraserve.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, UnknownLoRAError, WorkerDiedError
from loraserve.lora.adapter import LoRAAdapterError
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import resolve_adapter_name
from loraserve.models.loader import LoadedModel, open_model
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import SchedulerOutput, Sequence, SequenceStatus
from loraserve.worker.model_runner import LaunchedStep, ModelRunner
from loraserve.worker.processes import TensorParallelWorkers

logger = logging.getLogger(__name__)


class LLMEngine:
    """The synchronous engine. Not thread-safe: call it from one thread (AsyncLLMEngine does).

    Build it with `LLMEngine.from_args(EngineArgs(...))`; `__init__` takes the resolved config and the
    loaded model (rank 0's part of it, with the other ranks' `workers`, for tensor parallelism)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, workers: TensorParallelWorkers | None = None):
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.hf_config = loaded.hf_config
        self.eos_token_ids = set(loaded.generation_eos_ids)
        self.workers = workers
        self._dead: EngineDeadError | None = None  # why the engine can't step any more
        self.runner = ModelRunner.build(loaded.model, config, loaded.name, frozenset(self.eos_token_ids),
                                        workers.group if workers is not None else NO_PARALLEL, workers)
        self.lora_manager = LoRAManager(self.runner.lora) if self.runner.lora is not None else None
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.lora, self.lora_manager)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read yet
        self._lora_waits: dict[str, list[Sequence]] = {}  # adapter read in the background -> requests for it
        self._stop_workers = (weakref.finalize(self, _stop_workers, self.runner, workers) if workers is not None
                              else None)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "LLMEngine":
        """Check the options, read the model's config, resolve the engine's config, then load the model (with
        tensor parallelism: start the workers, which load their parts meanwhile)."""
        args.check()  # settings that don't depend on the model fail before anything is read
        source = open_model(args.model)
        config = args.create_config(source.max_position_embeddings)
        if config.parallel.tensor_parallel_size == 1:
            return cls(config, source.load(config.model.device, config.model.dtype, args.tokenizer,
                                           args.chat_template))
        config = replace(config, model=replace(config.model,
                                               device=config.parallel.device_of(config.model.device, 0)))
        workers = TensorParallelWorkers(config)
        try:
            with workers.guard():
                tp = workers.connect(config.model.device)
                loaded = source.load(config.model.device, config.model.dtype, args.tokenizer, args.chat_template, tp)
                return cls(config, loaded, workers)
        except BaseException:
            workers.close()
            raise

    def shutdown(self) -> None:
        """Stop what the engine runs beside itself: the adapter reader (its process and thread) and the worker
        processes of a tensor-parallel engine, which can't step afterwards; idempotent."""
        if self.lora_manager is not None:
            self.lora_manager.close()
        if self._stop_workers is not None:
            self._stop_workers()
            self._dead = self._dead or EngineDeadError("the engine was shut down")

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

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

    def lora_root_path(self, name: str) -> str | None:
        """The checked folder `<lora_root>/<name>` of an adapter named by a request (loraserve.lora.resolver
        says what is refused), or None when the engine has no lora_root. Reads no engine state, so it may
        run on any thread."""
        root = self.config.lora.lora_root if self.config.lora is not None else None
        return resolve_adapter_name(name, root) if root is not None else None

    def adapter_path(self, lora_request: LoRARequest) -> str | None:
        """Where an adapter a request names is read from: the request's path, else its folder under the lora
        root (checked as lora_root_path does), else None (unknown)."""
        return lora_request.path if lora_request.path is not None else self.lora_root_path(lora_request.name)

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. An adapter it names that is not registered (its path, or its folder under the lora
        root) is read in the background: the request waits for it, and fails with its error (in the request's
        output) if it can't be read; a name that is unknown or leads out of the root raises here."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError(f"n={params.n}: the engine takes one completion per request (LLM.generate and "
                                      "the server give a request n completions)")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                                     "(the prompt and at least one generated token must fit)")
        seq = Sequence(request_id, text, ids, params, next(self._arrivals), None,
                       logprobs=[] if params.logprobs is not None else None,
                       prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None)
        if lora_request is not None:
            self._require_lora(f"request {request_id!r} asks for LoRA adapter {lora_request.name!r}, which")
            seq.lora_name = name = lora_request.name
            if name not in self.lora_manager.paths:  # read in the background; the request waits for it
                if name not in self._lora_waits:
                    path = self.adapter_path(lora_request)
                    if path is None:
                        raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
                    self.lora_manager.start_register(name, path)
                self._lora_waits.setdefault(name, []).append(seq)
                self._requests[request_id] = seq
                return
            self.lora_manager.acquire(name)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _admit_lora_waits(self) -> list[RequestOutput]:
        """Requests whose adapter was read in the background: into the queue once it is registered, failed
        with its error when it could not be (returned). Waits briefly for a read when nothing else can run."""
        idle = not self.scheduler.has_unfinished() and self._in_flight is None
        outputs = []
        for name, error in self.lora_manager.collect_registrations(wait=0.01 if idle else 0.0):
            for seq in self._lora_waits.pop(name, []):
                if error is None:
                    self.lora_manager.acquire(name)
                    self.scheduler.add(seq)
                    continue
                seq.error, seq.status, seq.finish_reason = str(error), SequenceStatus.FINISHED, "abort"
                outputs.append(self._make_output(seq))
                del self._requests[seq.request_id]
        return outputs

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
        waiting = self._lora_waits.get(seq.lora_name, []) if seq is not None else []
        if seq in waiting:  # its adapter is still being read (the read goes on and registers it)
            waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            del self._requests[request_id]
        elif seq is not None and not seq.is_finished:
            self._finish(seq, "abort")
            del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._lora_waits)

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
        if self.workers is None:
            return self._step()
        if self._dead is not None:
            raise type(self._dead)(str(self._dead))
        try:
            with self.workers.guard():
                return self._step()
        except WorkerDiedError as exc:
            self._dead = exc
            raise
        except Exception as exc:  # the other ranks may wait in a collective that rank 0 never reached
            self._dead = EngineDeadError("a step failed on rank 0 of the tensor-parallel engine, whose ranks are "
                                         f"out of step now: {exc}")
            self.shutdown()
            raise self._dead from exc

    def _step(self) -> list[RequestOutput]:
        admitted = self._admit_lora_waits() if self._lora_waits else []
        in_flight, self._in_flight = self._in_flight, None
        outputs = admitted + self._launch(self.scheduler.schedule(), in_flight)
        if self.lora_manager is not None and self.scheduler.waiting:  # waiting requests' adapters come in meanwhile
            idle = self._in_flight is None and in_flight is None  # nothing runs: a read may be waited for briefly
            self.lora_manager.prefetch(self.scheduler.waiting_loras(self.config.lora.max_loras),
                                       self.scheduler.running_loras(), idle)
        if in_flight is not None:
            outputs += self._read(in_flight)
        if not self.config.async_scheduling and self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            outputs += self._read(launched)
        return outputs

    def _launch(self, out: SchedulerOutput, in_flight: LaunchedStep | None) -> list[RequestOutput]:
        """Start `out` on the device (kept in self._in_flight); returns the outputs of requests failed on
        the way (a broken adapter)."""
        if out.is_empty:
            return []
        lora_ids: dict[str, int] = {}
        if self.lora_manager is not None:
            names = {s.seq.lora_name for s in out.scheduled if s.seq.lora_name is not None}
            running = self.scheduler.running_loras()
            try:
                lora_ids = self.lora_manager.prepare(names, running)
            except LoRAAdapterError as exc:
                self.scheduler.cancel(out)
                return self._fail_adapter(exc)
            self.scheduler.restart_stale(out)  # an adapter read again: its weights may differ from the cached K/V's
            if out.is_empty:
                return []
        self._in_flight = self.runner.execute(out, lora_ids, in_flight)
        now = time.monotonic()
        for item in out.scheduled:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if seq.lora_name is not None:
                    self.lora_manager.record_queue_time(seq.lora_name, now - seq.arrival_time)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq in self._in_flight.sequences:
            seq.num_pending_tokens += 1
        return []

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens (and prompt logprobs) and hand them to their sequences (with
        tensor parallelism through the workers' `wait_for`, which a worker's death ends)."""
        wait = self.workers.wait_for if self.workers is not None else None
        if launched.prompt_logprobs is not None:
            rows, values = launched.prompt_logprobs
            for (seq, position), entry in zip(rows.owners, values.to_host(wait)):
                seq.prompt_logprobs[position] = entry  # a recompute after preemption writes the same again
        if launched.samples is None:
            return []
        result = launched.samples.to_host(wait)
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
        The step's other sequences run in the next step (Scheduler.cancel)."""
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
                             seq.lora_name, seq.error,
                             list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (reading it changes nothing)."""
        mgr = self.lora_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.block_manager.num_blocks, kv_blocks_used=self.block_manager.num_used_blocks,
            lora_pool_bytes_total=mgr.pool_bytes_total if mgr else 0,
            lora_pool_bytes_used=mgr.pool_bytes_used if mgr else 0,
            lora_cpu_cache_bytes=mgr.cpu_cache_bytes if mgr else 0,
            loras_on_gpu=mgr.resident_on_gpu if mgr else [], loras_on_cpu=mgr.resident_on_cpu if mgr else [],
            lora_refcounts=dict(mgr.refcounts) if mgr else {},
            lora_loads=mgr.num_loads if mgr else 0,
            lora_gpu_loads=mgr.num_gpu_loads if mgr else 0,
            lora_gpu_evictions=mgr.num_gpu_evictions if mgr else 0,
            lora_recent_load_seconds=list(mgr.recent_load_seconds) if mgr else [],
            lora_adapters={name: vars(c) for name, c in mgr.counters().items()} if mgr else {},
            **self._prefix_cache_stats())

    def _prefix_cache_stats(self) -> dict:
        counts = self.scheduler.prefix_cache_counts
        registered = set(self.lora_manager.paths) if self.lora_manager else set()
        return dict(prefix_cache_queries=sum(c.queries for c in counts.values()),
                    prefix_cache_hits=sum(c.hits for c in counts.values()),
                    prefix_cache_adapters={name: dict(vars(c)) for name, c in counts.items()
                                           if name is None or name in registered})


def _stop_workers(runner: ModelRunner, workers: TensorParallelWorkers) -> None:
    """A tensor-parallel engine's end (shutdown, garbage collection or the interpreter's exit): its graphs
    released, then its workers stopped and the group left (NCCL's abort would wait for the graphs). After a
    worker died they are abandoned instead: rank 0's device may still wait in a collective, and destroying a
    graph then blocks."""
    if workers.failure is None:
        runner.release_graphs()
    else:
        runner.abandon_graphs()
    workers.close()
