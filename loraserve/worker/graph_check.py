"""Start-up integrity check of the CUDA graphs: wrong output is never an option.

Each decode bucket replays a probe batch that mixes base rows with probe adapters of
different ranks and is compared to the eager forward on the same padded inputs
(same shapes, so the same kernels: only capture itself can make them differ).
Each bucket of the graphs of steps that prefill (worker/mixed_graphs.py) replays
a probe step of decode rows and a prompt chunk, with the probe adapters, and is
compared to the eager forward of the same step. The probe adapters are loaded
into the adapter pool through the LoRA runtime and released afterwards. A bucket
that disagrees is dropped (served eagerly) with an error in the log. With tensor
parallelism every rank checks its own decode graphs in step with the others (each
packs its own part of the same probe adapters) and a bucket that fails on any
rank is dropped on all.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from loraserve.lora.synthetic import random_adapter
from loraserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

RELATIVE_TOLERANCE = 1e-2
PROBE_ADAPTER_STD = 0.05  # B's scale: large enough that an adapter row clearly differs from a base row


def _load_probes(lora, seed: int) -> list[int]:
    """Random adapters of mixed ranks (max, max/2, 1) in the pool, as many as the pool and a step hold; their ids."""
    probe_ids = []
    if lora is None:
        return probe_ids
    max_rank = lora.config.max_lora_rank
    pages = 0
    for i, rank in enumerate([max_rank, max(1, max_rank // 2), 1][:lora.config.max_loras]):
        pages += lora.pool.layout.pages_for(rank)
        if pages > lora.pool.num_pages:
            break
        adapter = random_adapter(lora.spec, f"probe-{i}", rank, seed=seed + i, std=PROBE_ADAPTER_STD)
        adapter_id, done = lora.load(lora.pack(adapter, local_only=True))
        lora.wait_for(done)
        probe_ids.append(adapter_id)
    return probe_ids


def _agrees(graph_out: torch.Tensor, eager_out: torch.Tensor) -> tuple[bool, float]:
    err = float((graph_out.float() - eager_out.float()).abs().max())
    scale = float(eager_out.float().abs().max()) or 1.0
    return err <= RELATIVE_TOLERANCE * scale and bool(torch.isfinite(graph_out).all()), err


@torch.inference_mode()
def verify_graphs(runner, seed: int = 0) -> list[int]:
    """Check every captured decode bucket of `runner` (a ModelRunner); returns the buckets that failed (dropped)."""
    graphs = runner.graph_runner

    def compare(bucket: int, rng, probe_ids: list[int]):
        n = bucket - 1 if bucket > 1 else 1  # leave a padding row where there is room
        blocks_per_row = min(3, runner.num_blocks // n)
        if blocks_per_row < 1:
            return None
        probe = _probe_batch(rng, n, blocks_per_row, runner.block_size, probe_ids, runner.model.config.vocab_size,
                             graphs.max_blocks)
        ok, err = _agrees(graphs.replay(probe).clone(), runner.forward_eager(graphs.pad(probe)))
        ok = runner.tp.agree([int(ok)], "min")[0] == 1  # a bucket that fails on one rank fails on all
        return ok, err, f"{int((probe.token_adapters >= 0).sum())} adapter rows"

    return _check_buckets(runner, graphs, "bucket", compare, seed)


@torch.inference_mode()
def verify_mixed_graphs(runner, seed: int = 0) -> list[int]:
    """Check every captured bucket of `runner.mixed_graphs` (one rank); returns the buckets that failed (dropped).
    The eager forward runs the same step padded to the bucket by one more sequence over the dummy block, so
    that it has the graphs' shapes (and kernels); the real rows are compared."""
    graphs = runner.mixed_graphs

    def compare(bucket: int, rng, probe_ids: list[int]):
        probe = probe_prefill_step(rng, bucket, runner.block_size, probe_ids, runner.model.config.vocab_size,
                                   runner.config.model.max_model_len)
        if probe.block_tables.max() >= runner.num_blocks:
            return None
        padded = probe.padded_prefill(bucket, runner.dummy_block, runner.block_size)
        eager_out = runner.forward_eager(padded, rows=np.arange(probe.num_tokens))
        ok, err = _agrees(graphs.replay(probe).clone(), eager_out)
        return ok, err, f"{probe.num_tokens} tokens, {int((probe.token_adapters >= 0).sum())} with adapters"

    return _check_buckets(runner, graphs, "prefill bucket", compare, seed)


def _check_buckets(runner, graphs, label: str, compare, seed: int) -> list[int]:
    """Run `compare(bucket, rng, probe_ids)` -> (ok, error, description), or None to skip, on every bucket of
    `graphs` with the probe adapters loaded; drop the buckets that fail; returns them."""
    rng = np.random.default_rng(seed)
    probe_ids = _load_probes(runner.lora, seed)
    failed = []
    try:
        for bucket in sorted(graphs.graphs):
            verdict = compare(bucket, rng, probe_ids)
            if verdict is None:
                logger.warning("graph check: %s %d skipped (only %d KV blocks)", label, bucket, runner.num_blocks)
                continue
            ok, err, what = verdict
            logger.info("graph check: %s %3d, %s: max |graph - eager| = %.3g (%s)", label, bucket, what, err,
                        "ok" if ok else "FAILED")
            if not ok:
                logger.error("graph check: %s %d disagrees with eager; it will be served eagerly", label, bucket)
                graphs.drop(bucket)
                failed.append(bucket)
    finally:
        for adapter_id in probe_ids:
            runner.lora.release(adapter_id)
    return failed


def probe_prefill_step(rng, bucket: int, block_size: int, probe_ids: list[int], vocab: int,
                       max_model_len: int) -> StepInputs:
    """A step of `bucket` tokens or one fewer (a padding token where there is room): a few decode rows, then
    prompt chunks after some cached context (each sequence within max_model_len), every sequence over its
    own KV blocks; the decode rows take base and the probe adapters in turn, the chunks the probe adapters
    in turn (base without any)."""
    n = bucket - 1 if bucket > 32 else bucket
    decode = min(4, n // 4)
    context = int(rng.integers(0, min(2 * block_size, max_model_len // 4) + 1))
    longest = max(1, max_model_len - context - 1)
    chunks = []
    left = n - decode
    while left:
        chunks.append(min(left, longest))
        left -= chunks[-1]
    decode_lens = rng.integers(1, min(3 * block_size, max_model_len) + 1, size=decode)
    seq_lens = np.concatenate([decode_lens, [context + c for c in chunks]]).astype(np.int32)
    q_lens = np.array([1] * decode + chunks, dtype=np.int64)
    blocks = -(-seq_lens.astype(np.int64) // block_size)
    tables = np.zeros((len(seq_lens), int(blocks.max())), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    for i, (start, count) in enumerate(zip(first, blocks)):
        tables[i, :count] = np.arange(start, start + count)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    row = np.repeat(np.arange(len(seq_lens)), q_lens)
    positions = np.arange(n, dtype=np.int64) - query_start_loc[:-1][row] + (seq_lens - q_lens)[row]
    slot_mapping = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    choices = [-1, *probe_ids]
    chunk_choices = probe_ids or [-1]
    seq_adapters = np.array([choices[i % len(choices)] for i in range(decode)] +
                            [chunk_choices[i % len(chunk_choices)] for i in range(len(chunks))], dtype=np.int32)
    return StepInputs(rng.integers(0, vocab, size=n).astype(np.int64), positions, slot_mapping, tables, seq_lens,
                      query_start_loc, seq_adapters[row], (query_start_loc[1:] - 1).astype(np.int64), int(q_lens.max()))


def _probe_batch(rng, n: int, blocks_per_row: int, block_size: int, probe_ids: list[int], vocab: int,
                 max_blocks: int) -> StepInputs:
    """n decode rows over their own KV blocks, random lengths and tokens, rows taking base and the probe
    adapters in turn."""
    seq_lens = rng.integers(1, blocks_per_row * block_size + 1, size=n).astype(np.int32)
    tables = np.zeros((n, min(blocks_per_row, max_blocks)), dtype=np.int32)
    for i in range(n):
        tables[i] = np.arange(i * blocks_per_row, i * blocks_per_row + tables.shape[1])
    positions = (seq_lens - 1).astype(np.int64)
    slot_mapping = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    lora = np.array([probe_ids[i % (len(probe_ids) + 1) - 1] if i % (len(probe_ids) + 1) else -1 for i in range(n)],
                    dtype=np.int32)
    return StepInputs(rng.integers(0, vocab, size=n).astype(np.int64), positions, slot_mapping, tables, seq_lens,
                      np.arange(n + 1, dtype=np.int32), lora, np.arange(n, dtype=np.int64), 1)
