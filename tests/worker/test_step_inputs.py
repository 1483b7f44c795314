"""Step inputs on the host: the one preparation path against a per-token loop, and the graphs' padding rule."""
import dataclasses
import random

import numpy as np
import pytest

from loraserve.sampling_params import SamplingParams
from loraserve.sequence import PENDING_TOKEN, ScheduledSequence, Sequence
from loraserve.worker.step_inputs import StepInputs

BLOCK = 8


def _step(rng: random.Random, num_seqs: int, decode_only: bool) -> list[ScheduledSequence]:
    """Sequences at random progress with shuffled block tables; each computes a chunk (or one token)."""
    scheduled = []
    free_blocks = list(range(500))
    rng.shuffle(free_blocks)
    for i in range(num_seqs):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 60))]
        seq = Sequence(f"r{i}", None, prompt, SamplingParams(max_tokens=50), i, rng.choice([None, "a", "b"]))
        seq.output_token_ids = [rng.randrange(1, 1000) for _ in range(rng.randint(0, 5))]
        seq.num_pending_tokens = rng.randint(0, 1)
        total = seq.num_tokens
        if decode_only:
            seq.num_computed_tokens, n = total - 1, 1
        else:
            seq.num_computed_tokens = rng.randint(0, total - 1)
            n = rng.randint(1, total - seq.num_computed_tokens)
        seq.block_table = [free_blocks.pop() for _ in range(-(-total // BLOCK))]
        scheduled.append(ScheduledSequence(seq, n))
    return scheduled


def _expected(scheduled, lora_ids):
    """Per token, in a plain loop: id, position, KV slot, LoRA slot; per sequence: length; sampled rows."""
    ids, pos, kv, lora, lens, rows = [], [], [], [], [], []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        known = seq.prompt_token_ids + seq.output_token_ids
        for p in range(start, start + item.num_new_tokens):
            ids.append(known[p] if p < len(known) else PENDING_TOKEN)
            pos.append(p)
            kv.append(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
            lora.append(lora_ids[seq.lora_name] if seq.lora_name else -1)
        lens.append(start + item.num_new_tokens)
        if item.samples:
            rows.append(len(ids) - 1)
    return ids, pos, kv, lora, lens, rows


def test_prepare_matches_a_per_token_loop():
    rng = random.Random(0)
    lora_ids = {"a": 2, "b": 0}
    for trial in range(40):
        scheduled = _step(rng, rng.randint(1, 12), decode_only=trial % 2 == 0)
        inputs = StepInputs.prepare(scheduled, lora_ids, BLOCK)
        ids, pos, kv, lora, lens, rows = _expected(scheduled, lora_ids)
        assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == pos
        assert inputs.slot_mapping.tolist() == kv and inputs.token_adapters.tolist() == lora
        assert inputs.seq_lens.tolist() == lens and inputs.logits_rows.tolist() == rows
        counts = [item.num_new_tokens for item in scheduled]
        assert inputs.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
        assert inputs.max_query_len == max(counts) and inputs.is_decode == (max(counts) == 1)
        for i, item in enumerate(scheduled):
            table = item.seq.block_table
            assert inputs.block_tables[i, :len(table)].tolist() == table
        assert [a.dtype for a in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
                                  inputs.seq_lens, inputs.query_start_loc, inputs.token_adapters,
                                  inputs.logits_rows)] == [np.int64] * 3 + [np.int32] * 4 + [np.int64]


def test_padding_points_every_padding_row_at_the_dummy_block():
    rng = random.Random(1)
    inputs = StepInputs.prepare(_step(rng, 5, decode_only=True), {"a": 1, "b": 3}, BLOCK)
    dummy = 999
    padded = inputs.padded(8, 20, dummy, BLOCK)
    n = inputs.num_tokens
    assert padded.num_tokens == 8 and padded.block_tables.shape == (8, 20)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "token_adapters"):
        assert getattr(padded, name)[:n].tolist() == getattr(inputs, name).tolist()
    assert padded.input_ids[n:].tolist() == [0] * 3 and padded.positions[n:].tolist() == [0] * 3
    assert padded.seq_lens[n:].tolist() == [0] * 3 and padded.token_adapters[n:].tolist() == [-1] * 3
    assert padded.slot_mapping[n:].tolist() == [dummy * BLOCK] * 3
    width = inputs.block_tables.shape[1]
    assert (padded.block_tables[:n, :width] == inputs.block_tables).all()
    assert (padded.block_tables[:n, width:] == dummy).all() and (padded.block_tables[n:] == dummy).all()
    assert padded.query_start_loc.tolist() == list(range(9)) and padded.logits_rows.tolist() == list(range(n))
    empty = StepInputs.empty_decode().padded(4, 3, dummy, BLOCK)
    assert (empty.block_tables == dummy).all() and (empty.token_adapters == -1).all()


@pytest.mark.parametrize("query_lens,want", [([1, 1, 1], 3), ([1, 1, 5, 1], 2), ([4, 1, 1], 0), ([1], 1), ([], 0)])
def test_num_decode_rows_counts_the_leading_one_token_sequences(query_lens, want):
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    inputs = dataclasses.replace(StepInputs.empty_decode(), query_start_loc=qsl)
    assert inputs.num_decode_rows == want


def test_padded_prefill_adds_one_sequence_over_the_dummy_block():
    steps = dataclasses.replace(StepInputs.empty_decode(), input_ids=np.array([5, 6, 7], np.int64),
                                positions=np.array([9, 0, 1], np.int64), slot_mapping=np.array([41, 16, 17], np.int64),
                                block_tables=np.array([[2, 1], [1, 0]], np.int32), seq_lens=np.array([10, 2], np.int32),
                                query_start_loc=np.array([0, 1, 3], np.int32), token_adapters=np.array([0, -1, -1], np.int32),
                                logits_rows=np.array([0, 2], np.int64), max_query_len=2)
    padded = steps.padded_prefill(40, dummy_block=7, block_size=16)
    assert padded.num_tokens == 40 and padded.num_decode_rows == 1
    assert padded.query_start_loc.tolist() == [0, 1, 3, 40] and padded.seq_lens.tolist() == [10, 2, 37]
    assert padded.block_tables.shape == (3, 3) and (padded.block_tables[2] == 7).all()
    assert padded.block_tables[:2, :2].tolist() == [[2, 1], [1, 0]] and (padded.block_tables[:2, 2] == 7).all()
    assert (padded.slot_mapping[3:] // 16 == 7).all() and (padded.positions[3:] == 0).all()
    assert (padded.token_adapters[3:] == -1).all() and padded.logits_rows.tolist() == [0, 2]
    assert padded.max_query_len == 37 and steps.padded_prefill(3, 7, 16) is steps
