"""Continuous batching: which sequences run in the next step, and how many tokens each.

Policy per step (token budget `max_num_batched_tokens`, at most `max_num_seqs`):
1. Running sequences first, oldest first: a decode takes 1 token, a prompt still
   in prefill takes the next chunk (a sequence whose token in flight is its last
   by length is skipped). If KV blocks run out, the newest running
   sequence is preempted (blocks freed, recomputed later from the start).
2. Then waiting sequences while budget, blocks and sequence slots last. The
   running adapters (with the pinned ones) must fit the GPU adapter pool
   together (their pages) and number at most `max_loras` (distinct adapters in
   one step). Requests that need no new adapter (base model, running or pinned
   adapters) come first, first come first served; then the requests of other
   adapters, the adapter with the most waiting requests first, so that the
   pool's room holds as many requests as it can. A request whose adapter does
   not fit now, or is still being read (not in the pool or the host cache:
   the manager reads it ahead, and no step waits for a read), is passed over
   and never blocks the requests behind it.
3. No starvation: once the oldest request whose adapter does not fit has
   waited `max_wait_steps` steps (LoRAConfig), its adapter is offered room
   first; while it does not fit, no other new adapter may start, and the
   running adapter with the fewest running requests (pinned ones excepted) is
   drained: its new requests wait until its running ones finish and its room
   goes to the waiting adapter. So every
   request's wait is bounded by about max_wait_steps plus the longest running
   request of the drained adapters, whatever floods the other adapters.
4. Prefix caching: a waiting sequence starts with the longest chain of cached
   KV blocks of its tokens under its adapter's identity (block_manager.py) and
   computes only the rest; a request that asks for prompt logprobs computes its
   whole prompt (every prompt position's logits). Blocks a step fills are
   offered to the cache as it is scheduled, so requests admitted together share
   them. The tokens looked up and found are counted per adapter
   (`prefix_cache_counts`). A sequence whose adapter's identity changed between
   its admission and its step (its files were read again, changed) starts again from
   nothing (`restart_stale`); a step that is not launched takes back what it
   offered the cache, and the sequences it admitted wait again (`cancel`).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import AbstractSet, Protocol

from loraserve.config import LoRAConfig, SchedulerConfig
from loraserve.engine.block_manager import BlockManager, CachedPrefix
from loraserve.engine.stats import PrefixCacheCounts
from loraserve.sequence import ScheduledSequence, SchedulerOutput, Sequence, SequenceStatus


class AdapterRoom(Protocol):
    """What the scheduler asks about the GPU adapter pool (the LoRA manager answers)."""

    @property
    def pinned(self) -> AbstractSet[str]: ...  # adapters resident for good

    @property
    def num_pages(self) -> int: ...  # the pool's pages

    def pages_of(self, name: str) -> int: ...  # the pages adapter `name` takes

    def identity(self, name: str) -> int: ...  # stands for the weights `name` serves now (prefix cache keys)

    def is_ready(self, name: str) -> bool: ...  # `name` can be made resident without a read from disk


class _ActiveAdapters:
    """The adapters one step holds (running and pinned) and their pool pages, kept up to date while an
    admission pass adds adapters, so that `fits` costs O(1) per waiting request."""

    def __init__(self, names: AbstractSet[str], room: AdapterRoom, max_loras: int):
        self.names = set(names)
        self.room, self.max_loras = room, max_loras
        self.pages = sum(room.pages_of(n) for n in self.names)

    def fits(self, name: str) -> bool:
        """Whether `name` can be active beside the others: at most max_loras adapters, their pages in the pool."""
        return name in self.names or (len(self.names) < self.max_loras
                                      and self.pages + self.room.pages_of(name) <= self.room.num_pages)

    def add(self, name: str) -> None:
        if name not in self.names:
            self.names.add(name)
            self.pages += self.room.pages_of(name)


class Scheduler:
    """Queues and step building. `lora`: the adapter limits (None: LoRA off); `room`: the GPU adapter
    pool's size and the adapters' sizes in it (None: LoRA off)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora: LoRAConfig | None = None,
                 room: AdapterRoom | None = None):
        if (lora is None) != (room is None):
            raise ValueError("the scheduler needs both the LoRA limits and the adapter pool, or neither")
        self.config = config
        self.block_manager = block_manager
        self.max_loras = lora.max_loras if lora is not None else 0
        self.max_wait_steps = lora.max_wait_steps if lora is not None else 0
        self._room = room
        self._step = 0  # schedule() calls so far
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitted: set[Sequence] = set()  # admitted by the last schedule()
        self._starving: str | None = None  # the starving adapter of the last schedule() (_starving_adapter)
        self._running_loras: Counter[str] = Counter()  # adapter -> running sequences using it
        self.num_preemptions = 0  # since start
        self.prefix_cache_counts: dict[str | None, PrefixCacheCounts] = {}  # adapter (None: base) -> since start

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.queued_at_step = self._step
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_loras(self) -> set[str]:
        return set(self._running_loras)

    def waiting_loras(self, limit: int) -> list[str]:
        """The adapters of waiting requests that are not running, in the order they will be offered room (the
        starving adapter, then the most waiting requests first, then the first to arrive), at most `limit`."""
        counts: Counter[str] = Counter(seq.lora_name for seq in self.waiting
                                       if seq.lora_name is not None and seq.lora_name not in self._running_loras)
        names = [name for name, _ in counts.most_common()]  # ties keep first-arrival order
        if self._starving in counts:
            names.remove(self._starving)
            names.insert(0, self._starving)
        return names[:limit]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._drop_lora(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._admitted = set()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending_token_ends_it(self.config.max_model_len):
                i += 1  # its token in flight is its last: nothing more to compute
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: it was the newest
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            if (seq.num_computed_tokens + n) // block_size > seq.num_computed_tokens // block_size:
                self.block_manager.cache_blocks(seq, seq.num_computed_tokens + n)  # it fills a block
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted: list[Sequence] = []
        pinned = self._room.pinned if self._room is not None else frozenset()
        active = _ActiveAdapters(self._running_loras.keys() | pinned, self._room, self.max_loras) \
            if self._room is not None else None
        starving = self._starving = self._starving_adapter(pinned)
        draining = self._draining(starving, pinned, active) if starving is not None else None
        for seq in self._admission_order(starving, active):
            if budget <= 0 or len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            name = seq.lora_name
            if name is not None and name not in pinned and not self._may_run(name, starving, draining, active):
                continue  # its adapter does not fit now: the requests behind it go on
            prefix = self._cached_prefix(seq)
            start = max(seq.num_computed_tokens, prefix.num_tokens)
            n = min(seq.num_tokens - start, budget)
            if not self.block_manager.can_allocate(seq, start + n, prefix):
                break
            self.block_manager.allocate(seq, start + n, prefix)
            self.block_manager.cache_blocks(seq, start + n)
            self._count_lookup(seq, prefix)
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            if name is not None:
                active.add(name)
                self._running_loras[name] += 1
            admitted.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)
        self._admitted = set(admitted)

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The cached blocks a waiting sequence starts with. A request for prompt logprobs needs the logits of
        every prompt position, so it looks nothing up; nor does a sequence that has computed tokens already
        (benchmarks start sequences in the decode state that way)."""
        identity = self._room.identity(seq.lora_name) if seq.lora_name is not None else None
        lookup = seq.sampling_params.prompt_logprobs is None and seq.num_computed_tokens == 0
        return self.block_manager.cached_prefix(seq, identity, lookup)

    def _count_lookup(self, seq: Sequence, prefix: CachedPrefix) -> None:
        if prefix.looked_up:
            counts = self.prefix_cache_counts.setdefault(seq.lora_name, PrefixCacheCounts())
            counts.queries += seq.num_tokens
            counts.hits += prefix.num_tokens

    def restart_stale(self, out: SchedulerOutput) -> None:
        """Call once the step's adapters are resident: a scheduled sequence whose adapter identity is no longer
        the one its blocks are keyed under (its files were read again since it was admitted, in another
        version) leaves the step and waits to start again from nothing, so that no K/V computed with other
        weights is mixed into it."""
        if self._room is None or not self.block_manager.enable_prefix_caching:
            return
        current: dict[str, int] = {}
        stale = []
        for item in out.scheduled:
            name = item.seq.lora_name
            if name is not None:
                if name not in current:
                    current[name] = self._room.identity(name)
                if self.block_manager.identity_of(item.seq) != current[name]:
                    stale.append(item)
        for item in stale:
            out.scheduled.remove(item)
            self._preempt(item.seq)
            out.preempted.append(item.seq)

    def cancel(self, out: SchedulerOutput) -> None:
        """The step `out` was not launched: the blocks it was to compute are not in the cache. The sequences it
        admitted wait again (their cached prefix may hold such blocks); the others keep their blocks and run
        in the next step."""
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished meanwhile
            if seq in self._admitted:
                self._requeue(seq)
            else:
                self.block_manager.uncache_uncomputed(seq)

    def _admission_order(self, starving: str | None, active: _ActiveAdapters | None) -> list[Sequence]:
        """The waiting requests in the order they are offered a place: the starving adapter's, then those
        that need no new adapter (base model, running or pinned adapters), first come first served; then the
        other adapters' requests, the adapter with the most waiting requests first (the pool's room carries
        the most requests that way), each adapter's first come first served."""
        if active is None:
            return list(self.waiting)
        first, later = [], {}
        for seq in self.waiting:
            name = seq.lora_name
            if name == starving or name is None or name in active.names:
                first.append(seq)
            else:
                later.setdefault(name, []).append(seq)
        if starving is not None:
            first.sort(key=lambda seq: seq.lora_name != starving)  # stable: each part stays in arrival order
        for group in sorted(later.values(), key=len, reverse=True):  # stable: ties in order of first arrival
            first += group
        return first

    def _may_run(self, name: str, starving: str | None, draining: str | None, active: _ActiveAdapters) -> bool:
        """Whether a request of the (unpinned) adapter `name` may be admitted now."""
        if name in self._running_loras:
            return name != draining  # a draining adapter takes no new requests: its room goes to the starving one
        if not self._room.is_ready(name):
            return False  # still being read: no step waits for a read
        if starving is not None and name != starving and not active.fits(starving):
            return False  # room that frees is kept for the starving adapter
        return active.fits(name)

    def _starving_adapter(self, pinned: AbstractSet[str]) -> str | None:
        """The adapter of the oldest waiting request that is not running and has waited max_wait_steps, or
        None."""
        if not self.max_loras:
            return None  # LoRA is off: no request names an adapter
        for seq in self.waiting:
            name = seq.lora_name
            if (name is not None and name not in pinned and name not in self._running_loras
                    and self._step - seq.queued_at_step >= self.max_wait_steps):
                return name
        return None

    def _draining(self, starving: str, pinned: AbstractSet[str], active: _ActiveAdapters) -> str | None:
        """While the starving adapter does not fit, the running adapter that gives its room up next: the one
        with the fewest running requests (then by name), never a pinned one; None once it fits."""
        if active.fits(starving):
            return None
        candidates = [name for name in self._running_loras if name not in pinned]
        return min(candidates, key=lambda name: (self._running_loras[name], name), default=None)

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """A running sequence back to the front of the queue, to start again from nothing."""
        self.running.remove(seq)
        self._drop_lora(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.queued_at_step = self._step
        self.waiting.appendleft(seq)

    def _drop_lora(self, seq: Sequence) -> None:
        if seq.lora_name is not None:
            self._running_loras[seq.lora_name] -= 1
            if self._running_loras[seq.lora_name] <= 0:
                del self._running_loras[seq.lora_name]
