"""Paged KV-cache bookkeeping in plain Python: which blocks each sequence holds, and the prefix cache.

Prefix caching (on unless `enable_prefix_caching=False`): a full block is known by a key, SHA-256 of (the
key of the block before it, the adapter identity, the block's token ids), so equal keys mean the same tokens
from position 0 on under the same adapter weights: the same K/V. A block enters the cache when the step that
fills it is scheduled (a sequence admitted later in that step may take it: each layer writes the step's K/V
before it attends) and leaves it again if that step is not launched. A sequence that starts (new, or again
after preemption) takes the longest chain of cached blocks of its tokens and computes only the rest, at least
its last token. Blocks are reference counted; a shared block is full and only its first holder writes it,
once. A freed block keeps its key and stays in the cache until its memory is needed: free blocks without a
key are handed out first, then cached ones least recently freed first, the end of a freed chain before its
start.

The adapter identity is not the adapter's name: it is a number the LoRA manager gives each registration and
each read of an adapter's files in another version (`LoRAManager.identity`), so a name removed and added again
with other weights, or files read again after they changed, never meet blocks computed with other weights. None stands
for the base model. Everything here is host bookkeeping: no device work, no sync.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loraserve.sequence import Sequence

ROOT_KEY = bytes(32)  # the parent key of a sequence's first block


def block_key(parent: bytes, identity: int | None, tokens: list[int]) -> bytes:
    """The key of a full block: SHA-256 over its parent's key, the adapter identity (None: the base model)
    and its token ids, each part of fixed length (so the parts cannot run into each other)."""
    h = hashlib.sha256(parent)
    h.update(b"\0" * 9 if identity is None else b"\1" + identity.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class CachedPrefix:
    """What the prefix cache holds of a sequence's first tokens: `blocks` (in order) and their keys, found
    under adapter `identity`. Found without taking references: pass it to `allocate` in the same step."""

    identity: int | None
    keys: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_size: int = 0
    looked_up: bool = False  # False: nothing was looked up (prefix caching off, or not asked)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass
class _Chain:
    """A sequence's part in the prefix cache: the identity its blocks are keyed under and the keys of its
    first full blocks (found cached, or offered to the cache since)."""

    identity: int | None
    keys: list[bytes]


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` tokens each, with a prefix cache over them.

    A sequence's block_table grows as it needs room (`can_allocate` / `allocate` for a target token count;
    the first allocation takes a `CachedPrefix` from `cached_prefix`), offers its full blocks to the cache
    with `cache_blocks` as the steps that compute them are scheduled, and is returned whole by `free`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks  # sequences holding each block
        self._clean: deque[int] = deque(range(num_blocks))  # free blocks without a key
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free blocks with a key, least recently freed first
        self._key_of: dict[int, bytes] = {}  # cached block -> its key (held or free)
        self._block_of: dict[bytes, int] = {}  # key -> the cached block
        self._chains: dict[Sequence, _Chain] = {}  # sequences holding blocks (prefix caching on)
        self.num_evictions = 0  # cached blocks handed out for new K/V since start

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose K/V the cache can hand to a new sequence (held or free)."""
        return len(self._block_of)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # -- the prefix cache ----------------------------------------------------------------
    def cached_prefix(self, seq: Sequence, identity: int | None, lookup: bool = True) -> CachedPrefix:
        """The longest chain of cached blocks that begins `seq` (which holds no blocks) under adapter
        `identity`; empty when prefix caching is off or `lookup` is False. At least the last token is left
        to compute (its logits give the next token), and only tokens known on the host are looked up."""
        prefix = CachedPrefix(identity, block_size=self.block_size, looked_up=self.enable_prefix_caching and lookup)
        if not prefix.looked_up:
            return prefix
        bs = self.block_size
        parent = ROOT_KEY
        for i in range(min(seq.num_tokens - 1, seq.num_resolved_tokens) // bs):
            key = block_key(parent, identity, seq.token_range(i * bs, (i + 1) * bs))
            block = self._block_of.get(key)
            if block is None:
                break
            prefix.keys.append(key)
            prefix.blocks.append(block)
            parent = key
        return prefix

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the cache the full blocks among the first `num_tokens` tokens of `seq` whose ids are known on
        the host, called when a step that fills a block is scheduled: a sequence admitted later in the same
        step may take them, since each layer writes the step's K/V before it attends. A block with a token
        still in flight (a decode step of async scheduling) waits for the next call, or for `free`. A key
        already cached keeps its block (this one stays the sequence's own). If the step does not run,
        `uncache_uncomputed` takes them back."""
        chain = self._chains.get(seq)
        if chain is None:
            return
        bs = self.block_size
        for i in range(len(chain.keys), min(num_tokens, seq.num_resolved_tokens) // bs):
            parent = chain.keys[-1] if chain.keys else ROOT_KEY
            key = block_key(parent, chain.identity, seq.token_range(i * bs, (i + 1) * bs))
            chain.keys.append(key)
            if key not in self._block_of:
                block = seq.block_table[i]
                self._block_of[key] = block
                self._key_of[block] = key

    def uncache_uncomputed(self, seq: Sequence) -> None:
        """The step that was to compute blocks of `seq` did not run: the cache forgets those of them it got
        from `seq`, whose K/V was never written."""
        chain = self._chains.get(seq)
        if chain is None:
            return
        computed = seq.num_computed_tokens // self.block_size
        for i in range(computed, len(chain.keys)):
            block = seq.block_table[i]
            if self._block_of.get(chain.keys[i]) == block:
                del self._block_of[chain.keys[i]]
                del self._key_of[block]
        del chain.keys[computed:]

    def identity_of(self, seq: Sequence) -> int | None:
        """The adapter identity that the blocks of `seq` are keyed under (given when it started)."""
        return self._chains[seq].identity

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks replaying a trace); the blocks sequences hold stay theirs."""
        self._clean.extend(self._cached_free)
        self._cached_free.clear()
        self._key_of.clear()
        self._block_of.clear()

    # -- allocation ------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int, prefix: CachedPrefix | None = None) -> int:
        """Free blocks that `seq` takes to hold `num_tokens` tokens (with `prefix`, its first allocation: the
        prefix's blocks that are free now count too)."""
        held = len(seq.block_table) + (len(prefix.blocks) if prefix is not None else 0)
        new = max(0, -(-num_tokens // self.block_size) - held)
        revived = sum(1 for b in prefix.blocks if self._refs[b] == 0) if prefix is not None else 0
        return new + revived

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        return self.blocks_needed(seq, num_tokens, prefix) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, prefix: CachedPrefix | None = None) -> None:
        """Give `seq` room for `num_tokens` tokens. `prefix` (from `cached_prefix`, same step) is given with a
        sequence's first allocation: it takes the prefix's blocks first and its blocks are keyed under the
        prefix's identity from then on."""
        need = self.blocks_needed(seq, num_tokens, prefix)
        if need > self.num_free_blocks:
            raise RuntimeError(f"allocate: {need} blocks needed, {self.num_free_blocks} free (call can_allocate first)")
        if prefix is not None:
            if seq.block_table:
                raise RuntimeError("allocate: a cached prefix only starts a sequence that holds no blocks")
            for block in prefix.blocks:
                if self._refs[block] == 0:
                    del self._cached_free[block]
                self._refs[block] += 1
            seq.block_table = list(prefix.blocks)
            if self.enable_prefix_caching:
                self._chains[seq] = _Chain(prefix.identity, list(prefix.keys))
        for _ in range(-(-num_tokens // self.block_size) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        """A free block for new K/V: one without a key, else the least recently freed cached one (evicted)."""
        if self._clean:
            block = self._clean.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Return the blocks of `seq` (finished, aborted or preempted); its computed full blocks are cached
        first. A block no other sequence holds becomes free, keeping its key if it has one."""
        if seq in self._chains:
            self.uncache_uncomputed(seq)
            self.cache_blocks(seq, seq.num_computed_tokens)
            del self._chains[seq]
        for block in reversed(seq.block_table):  # a chain's end is evicted before its start
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached_free[block] = None
                else:
                    self._clean.append(block)
        seq.block_table = []
