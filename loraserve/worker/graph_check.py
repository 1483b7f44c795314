"""Start-up integrity check of the decode graphs (DESIGN.md section 3.5).

Each bucket replays a probe batch that mixes base rows with probe adapters of
different ranks and is compared to the eager forward on the same padded inputs
(same shapes, so the same kernels: only capture itself can make them differ). A
bucket that disagrees is dropped (served eagerly) with an error in the log:
wrong output is never an option.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from loraserve.worker.forward_context import AttentionMetadata, ForwardContext, lora_side_for_this_pass

logger = logging.getLogger(__name__)

RELATIVE_TOLERANCE = 1e-2


@torch.inference_mode()
def verify_graphs(graph_runner, model, num_blocks: int, lora_layers: list | None, seed: int = 0) -> list[int]:
    """Check every captured bucket; returns the buckets that failed (already dropped)."""
    rng = np.random.default_rng(seed)
    probe_slots = _write_probe_adapters(lora_layers, seed) if lora_layers else []
    failed = []
    try:
        for bucket in sorted(graph_runner.graphs):
            n = bucket - 1 if bucket > 1 else 1  # leave a padding row where there is room
            blocks_per_row = min(3, num_blocks // n)
            if blocks_per_row < 1:
                logger.warning("graph check: bucket %d skipped (only %d KV blocks)", bucket, num_blocks)
                continue
            probe = _probe_batch(rng, n, blocks_per_row, graph_runner.block_size, probe_slots,
                                 model.config.vocab_size, graph_runner.max_blocks)
            graph_out = graph_runner.run(*probe).clone()
            eager_out = _eager(model, graph_runner, bucket, *probe)
            err = float((graph_out.float() - eager_out.float()).abs().max())
            scale = float(eager_out.float().abs().max()) or 1.0
            ok = err <= RELATIVE_TOLERANCE * scale and bool(torch.isfinite(graph_out).all())
            logger.info("graph check: bucket %3d, %d adapter rows: max |graph - eager| = %.3g (%s)", bucket,
                        int((probe[5] >= 0).sum()) if probe[5] is not None else 0, err, "ok" if ok else "FAILED")
            if not ok:
                logger.error("graph check: bucket %d disagrees with eager; it will be served eagerly", bucket)
                graph_runner.drop(bucket)
                failed.append(bucket)
    finally:
        for slot in probe_slots:
            for _, layer in lora_layers:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
                layer.clear_slot(slot)
    return failed


def _write_probe_adapters(lora_layers, seed: int) -> list[int]:
    """Random adapters of mixed ranks (max, max/2, 1) in the first slots."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = lora_layers[0][1]
    num_slots = min(3, first.lora_a.shape[0])
    ranks = [first.max_rank, max(1, first.max_rank // 2), 1][:num_slots]
    for slot, rank in enumerate(ranks):
        for _, layer in lora_layers:
            weights = []
            for s in range(len(layer.slice_names)):
                out = layer.slice_offsets[s + 1] - layer.slice_offsets[s]
                a = torch.randn(rank, layer.in_features, generator=gen) / layer.in_features ** 0.5
                b = torch.randn(out, rank, generator=gen) * 0.05
                weights.append((a.to(layer.lora_a.device, layer.lora_a.dtype),
                                b.to(layer.lora_b.device, layer.lora_b.dtype)))
            layer.write_slot(slot, weights)
    return list(range(num_slots))


def _probe_batch(rng, n: int, blocks_per_row: int, block_size: int, probe_slots: list[int], vocab: int,
                 max_blocks: int):
    seq_lens = rng.integers(1, blocks_per_row * block_size + 1, size=n).astype(np.int32)
    tables = np.zeros((n, min(blocks_per_row, max_blocks)), dtype=np.int32)
    for i in range(n):
        tables[i] = np.arange(i * blocks_per_row, i * blocks_per_row + tables.shape[1])
    positions = (seq_lens - 1).astype(np.int64)
    slot_mapping = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    input_ids = rng.integers(0, vocab, size=n)
    lora = None
    if probe_slots:
        lora = np.array([(i % (len(probe_slots) + 1)) - 1 for i in range(n)], dtype=np.int64)
    return input_ids, positions, slot_mapping, seq_lens, tables, lora


def _eager(model, graph_runner, bucket: int, input_ids, positions, slot_mapping, seq_lens, tables,
           lora) -> torch.Tensor:
    """The eager forward on the same padded batch as the graph (same shapes, so the same kernels)."""
    dev = graph_runner.device
    n = input_ids.shape[0]
    pad = bucket - n
    ids = np.concatenate([input_ids, np.zeros(pad, np.int64)])
    pos = np.concatenate([positions, np.zeros(pad, np.int64)])
    slots = np.concatenate([slot_mapping, np.full(pad, graph_runner.dummy_slot, np.int64)])
    lens = np.concatenate([seq_lens, np.zeros(pad, np.int32)])
    padded_tables = np.full((bucket, graph_runner.max_blocks), graph_runner.dummy_slot // graph_runner.block_size,
                            dtype=np.int32)
    padded_tables[:n, :tables.shape[1]] = tables
    attn = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(padded_tables).to(dev),
        seq_lens=torch.from_numpy(lens).to(dev),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=dev), max_query_len=1, is_decode=True)
    meta = None
    if lora is not None:
        meta = graph_runner.lora_meta_builder.build(np.concatenate([lora, np.full(pad, -1, np.int64)]))
    out = model(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev),
                ForwardContext(attn, meta, lora_side_for_this_pass(graph_runner.lora_side)))
    return out[:n]
