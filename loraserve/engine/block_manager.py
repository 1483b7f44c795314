"""Paged KV-cache bookkeeping in plain Python: which blocks each sequence owns."""
from __future__ import annotations

from collections import deque

from loraserve.sequence import Sequence


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` tokens each.

    A sequence's block_table grows as it needs room (`can_allocate` /
    `allocate` for a target token count) and is returned whole by `free`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_tokens` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"allocate: {need} blocks needed, {len(self._free)} free (call can_allocate first)")
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
