"""Pinned host memory for packed adapters, pinned once at start-up and handed out in ranges.

An adapter's copy into the GPU pool overlaps the steps only from pinned (page-locked) host memory. Pinning
memory one adapter at a time while the engine serves stalls it: cudaHostAlloc holds the driver's locks while it
page-locks the memory, and a step launched meanwhile waits (0.15-0.2 s for each rank-16 Llama-3-8B adapter,
82 MiB, was measured on an H200: the step beside each read took as long). So `HostArena` pins one block when the
engine starts and hands out ranges of it, first fit; `hold(packed)` moves a packed adapter (read in ordinary
memory, in any thread) into a range, and `take_packed` gives a range for an adapter to be packed straight into.
Where the platform has memfd (Linux), the block is an anonymous shared-memory file (`fd`) pinned by registering it
with CUDA, so that the reader processes (lora/reader.py) map it too and pack adapters straight into their ranges:
no copy of an adapter in the engine's process. The runtime tells the arena of each copy to the GPU that reads a range
(`copied`, with its event); the range comes back with `give_back(tensor)`, or when the tensor is collected
without having been given back (an adapter read but never cached), and is reused once that copy is done.
Where no range fits, the adapter stays in ordinary memory: correct, but its copy to the GPU blocks the thread
that issues it.
"""
from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
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
    """`nbytes` of host memory (pinned with `pin`), handed out in ranges; thread-safe. The arena keeps, per range,
    the event of the last copy that reads it (`copied`), so a range given back or collected is reused only
    after that copy. `shared`: a shared-memory file other processes can map (`fd`; needs memfd)."""

    def __init__(self, nbytes: int, pin: bool = True, shared: bool = False):
        self.nbytes = _aligned(max(nbytes, ALIGN_BYTES))
        self.fd: int | None = None  # the shared-memory file, when shared
        if shared:
            self.fd = os.memfd_create("loraserve-host-arena", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.nbytes)
            mapped = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self._buffer = torch.frombuffer(mapped, dtype=torch.uint8)  # [bytes]
            if pin:  # page-locked in place; unregistered with the arena (cudaHostUnregister)
                _register(self._buffer)
                weakref.finalize(self, _unregister, self._buffer.data_ptr())
            weakref.finalize(self, os.close, self.fd)
        else:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]
        self._base = self._buffer.data_ptr()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (start, size), by start, never adjacent
        self._owners: dict[int, list] = {}  # start -> [size, token, last copy's event or None] of each range out
        self._waiting: list[tuple[int, int, object]] = []  # (start, size, event): given back, copies in flight
        self._tokens = itertools.count()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(size for _, size in self._free)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of `shape` and `dtype` in the arena, or None when no free range is large enough."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = self._take_range(nbytes)
        return None if start is None else self._view(start, shape, dtype, finalize=True)

    def hold(self, packed: PackedAdapter) -> PackedAdapter:
        """`packed` with its data and ranks copied into one range of the arena (its data's: `copied`, `give_back`),
        or `packed` itself where they don't fit."""
        taken = self.take_packed(tuple(packed.data.shape), packed.data.dtype, packed.ranks.numel())
        if taken is None:
            return packed
        data, ranks = taken
        data.copy_(packed.data)
        ranks.copy_(packed.ranks)
        return replace(packed, data=data, ranks=ranks)

    def take_packed(self, shape: tuple[int, int], dtype: torch.dtype,
                    num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One range for a packed adapter: (data [pages, width] of `dtype`, ranks [num_layers] int32), both
        uninitialised; the data's tensor stands for the range (`copied`, `give_back`, `offset_of`). None, logged,
        where they don't fit."""
        data_bytes = _aligned(math.prod(shape) * dtype.itemsize)
        start = self._take_range(data_bytes + num_layers * torch.int32.itemsize)
        if start is None:
            logger.debug("the pinned host arena has no room for %.1f MiB: an adapter stays in ordinary memory",
                         data_bytes / 2**20)
            return None
        data = self._view(start, shape, dtype, finalize=True)
        return data, self._view(start + data_bytes, (num_layers,), torch.int32, finalize=False)

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Where `tensor` (from this arena) starts in it: in the shared file, for another process's mapping."""
        return tensor.data_ptr() - self._base

    def copied(self, tensor: torch.Tensor, event) -> None:
        """A copy that reads `tensor`'s range was issued; `event` (a CUDA event) marks it done. A tensor from
        elsewhere is ignored."""
        with self._lock:
            owner = self._owners.get(tensor.data_ptr() - self._base)
            if owner is not None:
                owner[2] = event

    def give_back(self, tensor: torch.Tensor) -> None:
        """Return the range that `take` (or `hold`) gave as `tensor`, for reuse once its last copy is done. A
        tensor from elsewhere is ignored."""
        start = tensor.data_ptr() - self._base
        with self._lock:
            owner = self._owners.get(start)
        if owner is not None:
            self._release(start, owner[1])

    def _take_range(self, nbytes: int) -> int | None:
        size = _aligned(nbytes)
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
            self._owners[start] = [size, next(self._tokens), None]
            return start

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, finalize: bool) -> torch.Tensor:
        """A tensor over the arena's bytes from `offset`; with `finalize`, the range that starts there returns
        when the tensor is collected without having been given back (an adapter read but never cached)."""
        numel = math.prod(shape)
        view = self._buffer[offset:offset + _aligned(numel * dtype.itemsize)].view(dtype)[:numel].view(shape)
        if finalize:
            weakref.finalize(view, self._release, offset, self._owners[offset][1])
        return view

    def _release(self, start: int, token: int) -> None:
        with self._lock:
            owner = self._owners.get(start)
            if owner is None or owner[1] != token:  # given back already (the range may have a new owner)
                return
            del self._owners[start]
            size, _, event = owner
            if event is not None and not event.query():
                self._waiting.append((start, size, event))
            else:
                self._add_free(start, size)

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


def _register(buffer: torch.Tensor) -> None:
    """Page-lock `buffer`'s memory for CUDA (cudaHostRegister), so copies from it to the GPU are asynchronous."""
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    if error:
        raise RuntimeError(f"pinning the host arena failed (cudaHostRegister: cudaError {error})")


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
