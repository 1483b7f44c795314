"""A step's inputs on the host (numpy): made from the scheduled sequences in one place, and padded to a
CUDA graph bucket by one rule.

A step computes tokens [num_computed_tokens, num_computed_tokens + n) of each
scheduled sequence (T tokens of S sequences in all); one that reaches the end
of its sequence samples a token. Prefill, chunked prefill, decode and
recompute after preemption are all this one shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loraserve.sequence import PENDING_TOKEN, ScheduledSequence, Sequence


@dataclass
class StepInputs:
    """Host-side inputs of one step: T tokens of S sequences."""

    input_ids: np.ndarray  # [T] int64 (PENDING_TOKEN where the token is still on the device)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: KV cache slot (block * block_size + offset) of each token
    block_tables: np.ndarray  # [S, MB] int32
    seq_lens: np.ndarray  # [S] int32: context length after the step
    query_start_loc: np.ndarray  # [S+1] int32
    token_adapters: np.ndarray  # [T] int32 adapter id in the pool, -1 = base
    logits_rows: np.ndarray  # [N] int64: rows whose hidden state is sampled
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_decode_rows(self) -> int:
        """How many leading sequences have one new token each (their tokens are rows 0..D-1)."""
        longer = np.flatnonzero(np.diff(self.query_start_loc) != 1)
        return int(longer[0]) if longer.size else self.query_start_loc.shape[0] - 1

    @property
    def has_pending_tokens(self) -> bool:
        """Whether some input token is still on the device (sampled by the step in flight)."""
        return bool((self.input_ids == PENDING_TOKEN).any())

    @classmethod
    def prepare(cls, scheduled: list[ScheduledSequence], lora_ids: dict[str, int], block_size: int
                ) -> StepInputs:
        """The inputs of a scheduled step; lora_ids: adapter name -> its id in the GPU adapter pool.

        Per sequence only Python list work (its token ids, its block table row); the per-token arrays are
        computed with a few whole-step numpy operations."""
        seqs = [item.seq for item in scheduled]
        counts = [item.num_new_tokens for item in scheduled]
        starts = [seq.num_computed_tokens for seq in seqs]
        ids: list[int] = []
        for seq, start, n in zip(seqs, starts, counts):
            ids.extend(seq.token_range(start, start + n))
        tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int32)  # [S, MB]
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        counts_np, starts_np = np.asarray(counts, np.int64), np.asarray(starts, np.int64)
        query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(counts_np, out=query_start_loc[1:])
        row = np.repeat(np.arange(len(seqs)), counts_np)  # [T] the sequence of each token
        positions = np.arange(len(ids), dtype=np.int64) - query_start_loc[:-1][row] + starts_np[row]
        slot_mapping = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
        seq_ids = np.array([lora_ids[seq.lora_name] if seq.lora_name is not None else -1 for seq in seqs],
                             dtype=np.int32)
        samples = np.array([item.samples for item in scheduled], dtype=bool)
        return cls(np.asarray(ids, np.int64), positions, slot_mapping, tables,
                   (starts_np + counts_np).astype(np.int32), query_start_loc, seq_ids[row],
                   query_start_loc[1:][samples].astype(np.int64) - 1, max(counts))

    def pad_into(self, out, bucket: int, dummy_block: int, block_size: int) -> None:
        """Write this decode step, padded to `bucket` rows, into rows [0, bucket) of `out`'s input_ids,
        positions, slot_mapping, seq_lens, token_adapters and block_tables (numpy arrays at least that
        long, block_tables at least as wide as this step's): the CUDA graphs' padding rule.

        Padding rows are padding tokens (pad_tokens_into) with seq_len 0; every table entry past a row's own
        blocks is the dummy block. So padding can touch no real sequence's KV cache or output."""
        n = self.num_tokens
        if not self.is_decode and n:
            raise ValueError("only decode steps (one token per sequence) are padded")
        self.pad_tokens_into(out.input_ids, out.positions, out.slot_mapping, out.token_adapters, bucket,
                             dummy_block, block_size)
        out.seq_lens[:n], out.seq_lens[n:bucket] = self.seq_lens, 0
        out.block_tables[:bucket] = dummy_block
        out.block_tables[:n, :self.block_tables.shape[1]] = self.block_tables

    def pad_tokens_into(self, ids, positions, slots, adapters, bucket: int, dummy_block: int,
                        block_size: int) -> None:
        """Write this step's tokens, padded to `bucket`, into rows [0, bucket) of ids, positions, slots and
        adapters (numpy arrays at least that long): the graphs' padding rule for tokens. A padding token is
        token 0 at position 0, writes its K/V into the dummy block and names no adapter."""
        n = self.num_tokens
        ids[:n], ids[n:bucket] = self.input_ids, 0
        positions[:n], positions[n:bucket] = self.positions, 0
        slots[:n], slots[n:bucket] = self.slot_mapping, dummy_block * block_size
        adapters[:n], adapters[n:bucket] = self.token_adapters, -1

    def padded(self, bucket: int, max_blocks: int, dummy_block: int, block_size: int) -> StepInputs:
        """A new StepInputs: this decode step padded to `bucket` rows and `max_blocks` table columns (pad_into)."""
        out = StepInputs(np.empty(bucket, np.int64), np.empty(bucket, np.int64), np.empty(bucket, np.int64),
                         np.empty((bucket, max_blocks), np.int32), np.empty(bucket, np.int32),
                         np.arange(bucket + 1, dtype=np.int32), np.empty(bucket, np.int32), self.logits_rows, 1)
        self.pad_into(out, bucket, dummy_block, block_size)
        return out

    def padded_prefill(self, bucket: int, dummy_block: int, block_size: int) -> StepInputs:
        """A new StepInputs: this step with its padding tokens to `bucket` (pad_tokens_into) made one more
        sequence (every block the dummy block, nothing sampled), so that an eager forward runs the shapes of
        the step's padded graph (worker/mixed_graphs.py) while its real rows stay the same."""
        pad = bucket - self.num_tokens
        if pad <= 0:
            return self
        width = max(self.block_tables.shape[1], -(-pad // block_size))
        tables = np.full((self.block_tables.shape[0] + 1, width), dummy_block, dtype=np.int32)
        tables[:-1, :self.block_tables.shape[1]] = self.block_tables
        ids, positions, slots = (np.empty(bucket, np.int64) for _ in range(3))
        adapters = np.empty(bucket, np.int32)
        self.pad_tokens_into(ids, positions, slots, adapters, bucket, dummy_block, block_size)
        return StepInputs(ids, positions, slots, tables, np.concatenate([self.seq_lens, [pad]]).astype(np.int32),
                          np.concatenate([self.query_start_loc, [bucket]]).astype(np.int32), adapters,
                          self.logits_rows, max(self.max_query_len, pad))

    @classmethod
    def dummy_prefill(cls, num_tokens: int, max_len: int, dummy_block: int, block_size: int, adapter: int
                      ) -> StepInputs:
        """A prefill of `num_tokens` tokens in sequences of at most `max_len`, every K/V written to and read
        from the dummy block, every token with adapter id `adapter` (-1: base): a step that runs the eager
        path's kernels at this size without touching any sequence."""
        lengths = np.full(-(-num_tokens // max_len), max_len, dtype=np.int64)
        lengths[-1] = num_tokens - max_len * (len(lengths) - 1)
        query_start_loc = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        tables = np.full((len(lengths), -(-max_len // block_size)), dummy_block, dtype=np.int32)
        return cls(np.zeros(num_tokens, np.int64), positions, dummy_block * block_size + positions % block_size,
                   tables, lengths.astype(np.int32), query_start_loc, np.full(num_tokens, adapter, np.int32),
                   query_start_loc[1:].astype(np.int64) - 1, int(lengths.max()))

    @classmethod
    def empty_decode(cls) -> StepInputs:
        """A decode step of no sequence: padded, a batch of padding rows only."""
        ints = np.zeros(0, np.int64)
        return cls(ints, ints, ints, np.zeros((0, 0), np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32),
                   np.zeros(0, np.int32), ints, 1)


@dataclass
class DeviceStep:
    """What every rank of a tensor-parallel group computes for one step (ModelRunner.run): the inputs, the
    rows that score prompt tokens, whether the sampled rows' logits are needed; and the adapter loads the
    ranks other than 0 repeat before it (lora.runtime.PeerLoad). Sent once per step to each other rank."""

    inputs: StepInputs
    prompt_rows: np.ndarray | None  # [R] int64 rows of the step that score prompt tokens (PromptLogprobRows)
    samples: bool  # some row samples: the logits of inputs.logits_rows are computed
    adapter_loads: list = field(default_factory=list)  # [PeerLoad] in load order


@dataclass
class PromptLogprobRows:
    """The rows of a step whose next token is a prompt token of a request that asked for prompt_logprobs."""

    rows: np.ndarray  # [R] int64 rows of the step
    targets: list[int]  # [R] the prompt token each row predicts
    owners: list[tuple[Sequence, int]]  # [R] the sequence and the prompt position (1..P-1) each row scores
    num_top: list[int]  # [R] the top logprobs its request asked for

    @classmethod
    def find(cls, scheduled: list[ScheduledSequence], query_start_loc: np.ndarray) -> PromptLogprobRows | None:
        rows, targets, owners, num_top = [], [], [], []
        for i, item in enumerate(scheduled):
            seq = item.seq
            k = seq.sampling_params.prompt_logprobs
            if k is None:
                continue
            start, prompt = seq.num_computed_tokens, seq.prompt_token_ids
            for pos in range(start, min(start + item.num_new_tokens, len(prompt) - 1)):
                rows.append(int(query_start_loc[i]) + pos - start)
                targets.append(prompt[pos + 1])
                owners.append((seq, pos + 1))
                num_top.append(k)
        if not rows:
            return None
        return cls(np.asarray(rows, dtype=np.int64), targets, owners, num_top)


@dataclass
class PendingTokenFill:
    """Input rows whose token is still on the device: ids[rows] = in-flight samples[sources]."""

    rows: np.ndarray  # [K] int64 rows of this step's input_ids
    sources: np.ndarray  # [K] int64 rows of the in-flight step's samples
    tokens: torch.Tensor  # [M] int64 the in-flight step's samples (device)

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the tokens into the device input ids (no host sync)."""
        k = self.rows.shape[0]
        if np.array_equal(self.rows, self.sources) and np.array_equal(self.rows, np.arange(k)):
            input_ids[:k].copy_(self.tokens[:k])  # the usual decode case: same rows, same order
            return
        rows = torch.from_numpy(self.rows).to(input_ids.device, non_blocking=True)
        sources = torch.from_numpy(self.sources).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, sources).to(input_ids.dtype))

    @classmethod
    def find(cls, inputs: StepInputs, scheduled: list[ScheduledSequence], sampled_by: list,
             tokens: torch.Tensor | None) -> PendingTokenFill | None:
        """Where this step's input holds tokens sampled by the step in flight (its sampling sequences
        `sampled_by`, in row order, and their samples `tokens`), or None if nowhere."""
        rows = np.flatnonzero(inputs.input_ids == PENDING_TOKEN)
        if rows.size == 0:
            return None
        if tokens is None:
            raise RuntimeError("a pending token is scheduled but no step is in flight")
        source_of = {seq: i for i, seq in enumerate(sampled_by)}
        owners = np.searchsorted(inputs.query_start_loc, rows, side="right") - 1  # [K] scheduled index per row
        sources = np.array([source_of[scheduled[i].seq] for i in owners.tolist()], dtype=np.int64)
        return cls(rows.astype(np.int64), sources, tokens)
