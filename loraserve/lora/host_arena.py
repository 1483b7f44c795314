"""Pinned host memory for packed adapters, pinned once at start-up and handed out in ranges.

An adapter's copy into the GPU pool overlaps the steps only from pinned (page-locked) host memory. Pinning
memory one adapter at a time while the engine serves stalls it: cudaHostAlloc holds the driver's locks while it
page-locks the memory, and a step launched meanwhile waits (0.15-0.2 s for each rank-16 Llama-3-8B adapter,
82 MiB, was measured on an H200: the step beside each read took as long). So `HostArena` pins one block when the
engine starts and hands out ranges of it, first fit; `hold(packed)` moves a packed adapter (read in ordinary
memory, in any thread) into a range. A range comes back with `give_back(tensor, after)` once the copies that
read it are done (`after`: the event of the last one; ranges given back earlier wait for it), or when the
tensor is collected without having been given back (an adapter read but never cached). Where no range fits,
the adapter stays in ordinary memory: correct, but its copy to the GPU blocks the thread that issues it.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import weakref
from dataclasses import replace

import torch

from loraserve.lora.pool import PackedAdapter

logger = logging.getLogger(__name__)

ALIGN_BYTES = 128


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class HostArena:
    """`nbytes` of host memory (pinned with `pin`), handed out in ranges; thread-safe."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.nbytes = _aligned(max(nbytes, ALIGN_BYTES))
        self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]
        self._base = self._buffer.data_ptr()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (start, size), by start, never adjacent
        self._owners: dict[int, tuple[int, int]] = {}  # start -> (size, token) of each range handed out
        self._waiting: list[tuple[int, int, object]] = []  # (start, size, event): given back, copies in flight
        self._tokens = itertools.count()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(size for _, size in self._free)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of `shape` and `dtype` in the arena, or None when no free range is large enough."""
        numel = math.prod(shape)
        size = _aligned(numel * torch.empty((), dtype=dtype).element_size())
        with self._lock:
            self._reclaim()
            found = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if found is None:
                return None
            start, free = self._free[found]
            if free == size:
                del self._free[found]
            else:
                self._free[found] = (start + size, free - size)
            token = next(self._tokens)
            self._owners[start] = (size, token)
        view = self._buffer[start:start + size].view(dtype)[:numel].view(shape)
        weakref.finalize(view, self._release, start, token, None)  # never given back: free once collected
        return view

    def give_back(self, tensor: torch.Tensor, after=None) -> None:
        """Return the range that `take` gave as `tensor`, for reuse once `after` (a CUDA event, or None) has
        completed. A tensor from elsewhere is ignored."""
        start = tensor.data_ptr() - self._base
        with self._lock:
            owner = self._owners.get(start)
        if owner is not None:
            self._release(start, owner[1], after)

    def hold(self, packed: PackedAdapter) -> PackedAdapter:
        """`packed` with its data and ranks copied into the arena, or `packed` itself where they don't fit."""
        data = self.take(tuple(packed.data.shape), packed.data.dtype)
        ranks = self.take(tuple(packed.ranks.shape), packed.ranks.dtype) if data is not None else None
        if ranks is None:
            if data is not None:
                self.give_back(data)
            logger.debug("the pinned host arena has no room for %.1f MiB: an adapter stays in ordinary memory",
                         packed.data.numel() * packed.data.element_size() / 2**20)
            return packed
        data.copy_(packed.data)
        ranks.copy_(packed.ranks)
        return replace(packed, data=data, ranks=ranks)

    def _release(self, start: int, token: int, after) -> None:
        with self._lock:
            owner = self._owners.get(start)
            if owner is None or owner[1] != token:  # given back already (the range may have a new owner)
                return
            del self._owners[start]
            if after is not None and not after.query():
                self._waiting.append((start, owner[0], after))
            else:
                self._add_free(start, owner[0])

    def _reclaim(self) -> None:
        """Free the waiting ranges whose copies are done (the lock is held)."""
        still = []
        for start, size, event in self._waiting:
            if event.query():
                self._add_free(start, size)
            else:
                still.append((start, size, event))
        self._waiting = still

    def _add_free(self, start: int, size: int) -> None:
        """Insert a range into the free list, merged with its neighbours (the lock is held)."""
        i = next((k for k, (s, _) in enumerate(self._free) if s > start), len(self._free))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        if i < len(self._free) and start + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, size))
