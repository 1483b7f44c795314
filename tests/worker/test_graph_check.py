"""The start-up graph check's bookkeeping on the CPU (worker/graph_check.py), with stand-ins for the graphs and
the comparison: a bucket that disagrees is dropped (served eagerly), one without room is skipped and kept."""
import types

import numpy as np

from loraserve.worker import graph_check


class StandInGraphs:
    def __init__(self, buckets):
        self.graphs = dict.fromkeys(buckets)

    def drop(self, bucket):
        del self.graphs[bucket]


def test_buckets_that_disagree_are_dropped_and_the_others_kept():
    graphs = StandInGraphs([1, 8, 16, 32])
    seen = []

    def compare(bucket, rng, probe_ids):
        seen.append(bucket)
        assert isinstance(rng, np.random.Generator) and probe_ids == []
        if bucket == 8:
            return None  # no room for a probe: skipped, kept
        return bucket != 16, 0.5, "stand-in"

    runner = types.SimpleNamespace(lora=None, num_blocks=2)
    assert graph_check._check_buckets(runner, graphs, "bucket", compare, seed=0) == [16]
    assert seen == [1, 8, 16, 32] and sorted(graphs.graphs) == [1, 8, 32]


def test_a_prefill_probe_has_the_bucket_s_tokens_within_the_model_length():
    rng = np.random.default_rng(0)
    for bucket in (32, 96, 512):
        probe = graph_check.probe_prefill_step(rng, bucket, 16, [3, 5], 1000, max_model_len=128)
        assert probe.num_tokens == (bucket - 1 if bucket > 32 else bucket)
        assert probe.num_decode_rows == 4 and not probe.is_decode
        assert probe.seq_lens.max() <= 128 and probe.positions.max() < 128
        assert set(np.unique(probe.token_adapters)) <= {-1, 3, 5} and (probe.token_adapters[4:] >= 0).all()
        counts = np.diff(probe.query_start_loc)
        assert counts.sum() == probe.num_tokens and probe.max_query_len == counts.max()
        blocks = probe.block_tables[probe.block_tables > 0]
        assert len(np.unique(blocks)) == len(blocks)  # every sequence over its own blocks
