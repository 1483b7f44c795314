"""Start-up integrity check of the decode graphs: wrong output is never an option.

Each bucket replays a probe batch that mixes base rows with probe adapters of
different ranks and is compared to the eager forward on the same padded inputs
(same shapes, so the same kernels: only capture itself can make them differ).
The probe adapters are loaded into the adapter pool through the LoRA runtime
and released afterwards. A bucket that disagrees is dropped (served eagerly)
with an error in the log. With tensor parallelism every rank checks its own
graphs in step with the others (each packs its own part of the same probe
adapters) and a bucket that fails on any rank is dropped on all.
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


@torch.inference_mode()
def verify_graphs(runner, seed: int = 0) -> list[int]:
    """Check every captured bucket of `runner` (a ModelRunner); returns the buckets that failed (dropped)."""
    graphs, lora = runner.graph_runner, runner.lora
    rng = np.random.default_rng(seed)
    probe_ids = []
    if lora is not None:  # random adapters of mixed ranks (max, max/2, 1), as many as the pool and a step hold
        max_rank = lora.config.max_lora_rank
        pages = 0
        for i, rank in enumerate([max_rank, max(1, max_rank // 2), 1][:lora.config.max_loras]):
            pages += lora.pool.pages_for(rank)
            if pages > lora.pool.num_pages:
                break
            adapter = random_adapter(lora.spec, f"probe-{i}", rank, seed=seed + i, std=PROBE_ADAPTER_STD)
            adapter_id, done = lora.load(lora.pack(adapter, local_only=True))
            lora.wait_for(done)
            probe_ids.append(adapter_id)
    failed = []
    try:
        for bucket in sorted(graphs.graphs):
            n = bucket - 1 if bucket > 1 else 1  # leave a padding row where there is room
            blocks_per_row = min(3, runner.num_blocks // n)
            if blocks_per_row < 1:
                logger.warning("graph check: bucket %d skipped (only %d KV blocks)", bucket, runner.num_blocks)
                continue
            probe = _probe_batch(rng, n, blocks_per_row, runner.block_size, probe_ids, runner.model.config.vocab_size,
                                 graphs.max_blocks)
            graph_out = graphs.replay(probe).clone()
            eager_out = runner.forward_eager(graphs.pad(probe))
            err = float((graph_out.float() - eager_out.float()).abs().max())
            scale = float(eager_out.float().abs().max()) or 1.0
            ok = err <= RELATIVE_TOLERANCE * scale and bool(torch.isfinite(graph_out).all())
            ok = runner.tp.agree([int(ok)], "min")[0] == 1  # a bucket that fails on one rank fails on all
            logger.info("graph check: bucket %3d, %d adapter rows: max |graph - eager| = %.3g (%s)", bucket,
                        int((probe.token_adapters >= 0).sum()), err, "ok" if ok else "FAILED")
            if not ok:
                logger.error("graph check: bucket %d disagrees with eager; it will be served eagerly", bucket)
                graphs.drop(bucket)
                failed.append(bucket)
    finally:
        for adapter_id in probe_ids:
            lora.release(adapter_id)
    return failed


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
