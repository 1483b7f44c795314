"""The host arena (lora/host_arena.py) on the CPU, unpinned: ranges handed out first fit, given back after their
copies' events, collected when dropped, never overlapping, never lost."""
from __future__ import annotations

import gc
import mmap
import random

import torch

from loraserve.lora.host_arena import ALIGN_BYTES, HostArena
from loraserve.lora.pool import PackedAdapter


class FakeEvent:
    """A copy's event that completes when the test says so."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def _start(arena: HostArena, t: torch.Tensor) -> int:
    return t.data_ptr() - arena._base


def test_ranges_are_aligned_first_fit_and_merge_when_given_back():
    arena = HostArena(16 * ALIGN_BYTES, pin=False)
    a = arena.take((3, 5), torch.bfloat16)  # 30 bytes -> one aligned unit
    b = arena.take((2, 64), torch.float32)  # 512 bytes -> 4 units
    c = arena.take((7,), torch.int32)
    assert [_start(arena, t) for t in (a, b, c)] == [0, ALIGN_BYTES, 5 * ALIGN_BYTES]
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and b.shape == (2, 64) and c.dtype == torch.int32
    b.fill_(1.0)
    a.fill_(2.0)
    c.fill_(3)
    assert torch.all(b == 1.0) and torch.all(a == 2.0)  # the ranges do not overlap
    arena.give_back(b)
    d = arena.take((ALIGN_BYTES,), torch.uint8)  # fits in b's range: first fit
    assert _start(arena, d) == ALIGN_BYTES
    assert arena.take((11 * ALIGN_BYTES,), torch.uint8) is None  # 13 units free in all, but 3 + 10 apart
    for t in (a, c, d):
        arena.give_back(t)
    assert arena._free == [(0, arena.nbytes)]  # merged back into one range
    assert arena.take((16 * ALIGN_BYTES,), torch.uint8) is not None


def test_a_range_is_reused_only_once_its_copy_is_done():
    arena = HostArena(4 * ALIGN_BYTES, pin=False)
    a = arena.take((4 * ALIGN_BYTES,), torch.uint8)
    copy = FakeEvent()
    arena.copied(a, copy)
    arena.give_back(a)
    assert arena.take((ALIGN_BYTES,), torch.uint8) is None and arena.free_bytes == 0
    copy.done = True
    assert arena.free_bytes == arena.nbytes
    assert _start(arena, arena.take((ALIGN_BYTES,), torch.uint8)) == 0


def test_a_collected_range_waits_for_its_copy_too():
    arena = HostArena(3 * ALIGN_BYTES, pin=False)
    held = arena.hold(PackedAdapter(torch.ones(1, 64), (0,), torch.tensor([8], dtype=torch.int32)))  # one range
    assert arena.free_bytes == 0
    copy = FakeEvent()
    arena.copied(held.data, copy)
    del held  # dropped without being given back, its copy to the GPU still in flight
    gc.collect()
    assert arena.free_bytes == 0
    copy.done = True
    assert arena.free_bytes == arena.nbytes


def test_collected_ranges_come_back_and_a_stale_one_never_frees_its_successor():
    arena = HostArena(2 * ALIGN_BYTES, pin=False)
    dropped = arena.take((2 * ALIGN_BYTES,), torch.uint8)
    del dropped  # read but never cached: collected
    gc.collect()
    assert arena.free_bytes == arena.nbytes
    old = arena.take((ALIGN_BYTES,), torch.uint8)
    arena.give_back(old)
    new = arena.take((ALIGN_BYTES,), torch.uint8)  # the same range, another owner
    assert _start(arena, new) == 0
    del old
    gc.collect()  # the old tensor's finalizer must not free the new owner's range
    other = arena.take((ALIGN_BYTES,), torch.uint8)
    assert _start(arena, other) == ALIGN_BYTES
    assert arena.take((1,), torch.uint8) is None
    arena.give_back(torch.zeros(3))  # not the arena's: ignored
    assert arena.free_bytes == 0


def test_hold_moves_a_packed_adapter_in_and_falls_back_when_full():
    packed = PackedAdapter(torch.randn(2, 300).bfloat16(), (0, 2), torch.tensor([8, 0, 16], dtype=torch.int32))
    arena = HostArena(16 * ALIGN_BYTES, pin=False)
    held = arena.hold(packed)  # 1,200 bytes of data (10 units) and 12 of ranks (1 unit)
    assert torch.equal(held.data, packed.data) and torch.equal(held.ranks, packed.ranks)
    assert held.row_blocks == (0, 2) and _start(arena, held.data) == 0 and _start(arena, held.ranks) == 10 * ALIGN_BYTES
    assert arena.free_bytes == 5 * ALIGN_BYTES
    assert arena.hold(packed) is packed  # no room: it stays where it is
    assert arena.free_bytes == 5 * ALIGN_BYTES


def test_random_takes_and_gives_never_overlap_or_leak():
    rng = random.Random(0)
    arena = HostArena(256 * ALIGN_BYTES, pin=False)
    held: list[torch.Tensor] = []
    copies: list[FakeEvent] = []  # events of ranges given back while their copies were in flight
    for _ in range(10_000):
        if held and rng.random() < 0.5:
            event = FakeEvent() if rng.random() < 0.3 else None
            t = held.pop(rng.randrange(len(held)))
            if event is not None:
                arena.copied(t, event)
            arena.give_back(t)
            copies += [event] if event is not None else []
        elif rng.random() < 0.2:
            for event in copies:
                event.done = True
            copies = []
        else:
            t = arena.take((rng.randint(1, 40 * ALIGN_BYTES),), torch.uint8)
            if t is not None:
                held.append(t)
        spans = sorted((_start(arena, t), t.numel()) for t in held)
        assert all(s + n <= s2 for (s, n), (s2, _) in zip(spans, spans[1:]))
        free = sum(size for _, size in arena._free)
        owned = sum(size for size, _, _ in arena._owners.values())
        waiting = sum(size for _, size, _ in arena._waiting)
        assert free + owned + waiting == arena.nbytes
    for t in held:
        arena.give_back(t)
    for event in copies:
        event.done = True
    assert arena.free_bytes == arena.nbytes and arena._free == [(0, arena.nbytes)]


def test_a_shared_arena_is_one_file_another_mapping_sees():
    """A shared arena's bytes are its file's: what another mapping of `fd` writes at `offset_of(t)` is what `t`
    holds (how the reader processes pack into it), and take_packed's data and ranks lie in one range."""
    arena = HostArena(8 * ALIGN_BYTES, pin=False, shared=True)
    data, ranks = arena.take_packed((2, 8), torch.float32, 3)
    other = torch.frombuffer(mmap.mmap(arena.fd, arena.nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    written = torch.arange(16, dtype=torch.float32).view(2, 8)
    offset = arena.offset_of(data)
    other[offset:offset + written.numel() * 4].view(torch.float32).view(2, 8).copy_(written)
    assert torch.equal(data, written)
    assert arena.offset_of(ranks) == offset + ALIGN_BYTES  # 64 bytes of data, aligned, then the ranks
    arena.give_back(data)
    assert arena.free_bytes == arena.nbytes
