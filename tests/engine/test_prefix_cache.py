"""Prefix caching in the block manager and scheduler, without a model: keys, reuse, the last token, prompt
logprobs, eviction order, reference counts, adapter identities, and a randomized run that tracks what every
KV slot holds (1,000 requests, aborts, preemption, three identities, identities that change)."""
import random
from collections import Counter
from itertools import combinations

import pytest

from test_scheduler import FakeRoom
from loraserve.config import LoRAConfig, SchedulerConfig
from loraserve.engine.block_manager import ROOT_KEY, BlockManager, block_key
from loraserve.engine.scheduler import Scheduler
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import Sequence, SequenceStatus

BS = 4


def _seq(rid, tokens, max_tokens=4, lora=None, **params):
    return Sequence(str(rid), None, list(tokens), SamplingParams(max_tokens=max_tokens, **params), 0, lora)


def _computed(bm, rid, tokens):
    """A sequence that started in `bm` (taking what was cached) and has computed all of `tokens`."""
    seq = _seq(rid, tokens)
    bm.allocate(seq, len(seq.prompt_token_ids), bm.cached_prefix(seq, None))
    seq.num_computed_tokens = len(seq.prompt_token_ids)
    return seq


def _scheduler(num_blocks=64, budget=64, max_num_seqs=16, caching=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=512)
    return Scheduler(config, BlockManager(num_blocks, BS, caching), LoRAConfig(max_loras=8), FakeRoom())


def _step(sched):
    """One step as the engine runs it: schedule, the sequences advance; a sequence that samples gets token 7.
    Returns the scheduled (sequence, new tokens) pairs."""
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    for item in out.scheduled:
        if item.samples:
            item.seq.output_token_ids.append(7)
    return [(item.seq, item.num_new_tokens) for item in out.scheduled]


def _run(sched, seq):
    """Add `seq` and step until it has sampled once; returns the tokens it computed in its first step."""
    sched.add(seq)
    first = None
    while not seq.output_token_ids:
        for s, n in _step(sched):
            if s is seq and first is None:
                first = n
    return first


def test_block_key_depends_on_parent_identity_and_tokens():
    keys = {block_key(ROOT_KEY, None, [1, 2, 3, 4]), block_key(ROOT_KEY, 0, [1, 2, 3, 4]),
            block_key(ROOT_KEY, 1, [1, 2, 3, 4]), block_key(ROOT_KEY, None, [1, 2, 3, 5]),
            block_key(block_key(ROOT_KEY, None, [9, 9, 9, 9]), None, [1, 2, 3, 4])}
    assert len(keys) == 5  # the base model (None) is no adapter identity, not even 0
    assert block_key(ROOT_KEY, 3, [1, 2, 3, 4]) == block_key(ROOT_KEY, 3, [1, 2, 3, 4])


def test_a_second_request_reuses_the_shared_full_blocks():
    sched = _scheduler()
    shared = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    a = _seq("a", shared + [1, 2, 3])
    assert _run(sched, a) == 13
    b = _seq("b", shared + [5, 6, 7, 8, 9])
    assert _run(sched, b) == 15 - 8  # the 2 shared full blocks are reused, the rest computed
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    bm = sched.block_manager
    assert [bm.refcount(x) for x in a.block_table[:2]] == [2, 2]
    counts = sched.prefix_cache_counts[None]
    assert (counts.queries, counts.hits) == (13 + 15, 8)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    sched = _scheduler()
    prompt = list(range(50, 62))  # 3 full blocks
    a = _seq("a", prompt)
    _run(sched, a)
    sched.finish(a, "stop")
    b = _seq("b", prompt)
    assert _run(sched, b) == 4  # 2 blocks reused; the last block is computed again for the last token's logits
    assert sched.prefix_cache_counts[None].hits == 8
    c = _seq("c", prompt[:9])  # 9 tokens: 2 full blocks cached, and the 9th token to compute
    assert _run(sched, c) == 1


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt():
    sched = _scheduler()
    prompt = list(range(20, 36))
    _run(sched, _seq("a", prompt))
    b = _seq("b", prompt, prompt_logprobs=2)
    assert _run(sched, b) == 16
    assert sched.prefix_cache_counts[None].queries == 16  # b looked nothing up
    c = _seq("c", prompt + [1])  # b's blocks or a's: the prefix is there
    assert _run(sched, c) == 1


def test_no_block_is_shared_across_adapter_identities():
    sched = _scheduler()
    prompt = list(range(30, 42))
    seqs = [_seq(name or "base", prompt + [1], lora=name) for name in (None, "a", "b")]
    firsts = [_run(sched, s) for s in seqs]
    assert firsts == [13, 13, 13]
    assert all(not set(x.block_table) & set(y.block_table) for x, y in combinations(seqs, 2))
    assert all(c.hits == 0 for c in sched.prefix_cache_counts.values())
    again = _seq("a2", prompt + [2], lora="a")
    assert _run(sched, again) == 1 and again.block_table[:3] == seqs[1].block_table[:3]
    sched._room.identities["a"] = 99  # adapter "a" read again: its weights may differ
    fresh = _seq("a3", prompt + [3], lora="a")
    assert _run(sched, fresh) == 13


def test_prefix_caching_off_shares_nothing():
    sched = _scheduler(caching=False)
    prompt = list(range(30, 42))
    a, b = _seq("a", prompt), _seq("b", prompt)
    assert _run(sched, a) == 12 and _run(sched, b) == 12
    assert not set(a.block_table) & set(b.block_table)
    assert sched.prefix_cache_counts == {}


def test_freed_blocks_stay_cached_until_needed_and_go_least_recently_freed_first():
    bm = BlockManager(6, BS)
    old, new = _computed(bm, "old", range(100, 108)), _computed(bm, "new", range(200, 208))  # 2 blocks each
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    filler = _seq("filler", range(900, 912))
    bm.allocate(filler, 12, bm.cached_prefix(filler, None))  # 2 clean blocks, then 1 evicted: old's end
    assert bm.num_cached_blocks == 3
    again_old = _seq("again-old", list(range(100, 108)) + [1])
    assert len(bm.cached_prefix(again_old, None).blocks) == 1  # its first block survives, its second went
    again_new = _seq("again-new", list(range(200, 208)) + [1])
    assert len(bm.cached_prefix(again_new, None).blocks) == 2


def test_reference_counts_keep_shared_blocks_alive():
    bm = BlockManager(4, BS)
    a = _computed(bm, "a", range(10, 18))
    bm.cache_blocks(a, 8)
    b = _seq("b", list(range(10, 18)) + [1])
    prefix = bm.cached_prefix(b, None)
    assert prefix.blocks == a.block_table
    assert bm.blocks_needed(b, 9, prefix) == 1  # the shared blocks are held already: one new block
    bm.allocate(b, 9, prefix)
    bm.free(a)
    assert bm.num_free_blocks == 1 and all(bm.refcount(x) == 1 for x in b.block_table)
    c = _seq("c", range(40, 44))
    bm.allocate(c, 4, bm.cached_prefix(c, None))  # takes the last free block, never one of b's
    assert not set(c.block_table) & set(b.block_table)
    assert not bm.can_allocate(_seq("d", range(4)), 1)


def test_reviving_free_cached_blocks_counts_against_free_room():
    bm = BlockManager(3, BS)
    bm.free(_computed(bm, "a", range(10, 18)))
    b = _seq("b", list(range(10, 18)) + [1, 2, 3, 4, 5])
    prefix = bm.cached_prefix(b, None)
    assert len(prefix.blocks) == 2 and bm.blocks_needed(b, 13, prefix) == 4  # 2 revived + 2 new > 3 free
    assert not bm.can_allocate(b, 13, prefix) and bm.can_allocate(b, 12, prefix)
    bm.allocate(b, 12, prefix)
    assert bm.num_free_blocks == 0 and b.block_table[:2] == prefix.blocks


def test_a_sequence_whose_adapter_was_read_again_restarts_before_its_step():
    sched = _scheduler()
    prompt = list(range(60, 72))
    _run(sched, _seq("a", prompt + [1], lora="a"))
    b = _seq("b", prompt + [2], lora="a")
    sched.add(b)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled if i.seq is b] == [(b, 1)]  # 12 cached tokens
    sched._room.identities["a"] = 42  # the step's LoRA preparation read "a" again
    sched.restart_stale(out)
    assert b not in [i.seq for i in out.scheduled] and b in out.preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled if i.seq is b] == [(b, 13)]  # nothing under 42


def test_requests_admitted_in_one_step_share_what_the_first_computes():
    sched = _scheduler()
    shared = list(range(300, 316))  # 4 full blocks
    a, b = _seq("a", shared + [1, 2]), _seq("b", shared + [3])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 18), (b, 1)]
    assert b.block_table[:4] == a.block_table[:4]  # a writes them in this step, before b's attention reads them


def test_a_step_that_is_not_launched_takes_back_what_it_offered_the_cache():
    sched = _scheduler(budget=10)
    shared = list(range(300, 316))
    a, b = _seq("a", shared + [1, 2, 3]), _seq("b", shared + [9])
    sched.add(a)
    assert _step(sched) == [(a, 10)]  # 2 full blocks computed
    sched.add(b)
    out = sched.schedule()  # a's next 9 tokens fill 2 more blocks; b takes all 4, then computes 1
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 9), (b, 1)]
    sched.cancel(out)
    assert b.status is SequenceStatus.WAITING and not b.block_table and b.num_computed_tokens == 0
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 10
    assert sched.block_manager.num_cached_blocks == 2  # what a computed; not what the cancelled step was to
    sched.finish(a, "abort")  # a never computes the other two
    assert _step(sched) == [(b, 9)]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_requests_with_aborts_keep_every_slot_right_and_leak_nothing(seed):
    """1,000 requests whose prompts share prefixes (a few system prompts and their extensions) over the base
    model and two adapters, under a KV cache that forces preemption and eviction, with aborts, steps that are
    not launched (Scheduler.cancel) and adapter identities that change (Scheduler.restart_stale). Every KV
    slot records what was computed there: the identity and the tokens up to its position. A step writes its
    new tokens' slots (each slot by one sequence), then every sequence it runs must find, in all the slots
    before its new tokens, its own tokens computed under its adapter's current identity: blocks taken from
    the cache, also from a sequence of the same step, included."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=48, max_model_len=512)
    room = FakeRoom()
    sched = Scheduler(config, BlockManager(40, BS), LoRAConfig(max_loras=8), room)
    bm = sched.block_manager
    slots = {}  # (block, offset) -> (identity, tuple of tokens up to and including that position)
    systems = [[rng.randrange(1000) for _ in range(rng.randint(4, 24))] for _ in range(5)]
    pending = []
    for i in range(1000):
        prompt = list(rng.choice(systems)) + [rng.randrange(1000) for _ in range(rng.randint(0, 10))]
        pending.append(_seq(i, prompt, rng.randint(1, 12), rng.choice([None, "a", "b"])))
    finished = aborted = cancelled = steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 6)):
            if pending:
                sched.add(pending.pop())
        out = sched.schedule()
        if rng.random() < 0.02:  # an adapter read again: its cached blocks must never be reused
            room.identities[rng.choice(["a", "b"])] = rng.randrange(100, 10**6)
        sched.restart_stale(out)
        owners = Counter(b for s in list(sched.running) + list(sched.waiting) for b in s.block_table)
        assert all(bm.refcount(b) == n for b, n in owners.items())
        assert len(owners) + bm.num_free_blocks == bm.num_blocks
        if out.scheduled and rng.random() < 0.1:  # the step is not launched (an adapter failed to load)
            sched.cancel(out)
            cancelled += 1
            out.scheduled = []
        written = set()
        for item in out.scheduled:
            seq = item.seq
            ident = room.identity(seq.lora_name) if seq.lora_name else None  # the weights it runs with now
            tokens = seq.token_range(0, seq.num_computed_tokens + item.num_new_tokens)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                slot = (seq.block_table[pos // BS], pos % BS)
                assert slot not in written, "two sequences write one slot in a step"
                written.add(slot)
                slots[slot] = (ident, tuple(tokens[:pos + 1]))
        for item in out.scheduled:
            seq = item.seq
            ident = room.identity(seq.lora_name) if seq.lora_name else None
            tokens = seq.token_range(0, seq.num_computed_tokens)
            for pos in range(seq.num_computed_tokens):  # what its attention reads: its own history
                assert slots[(seq.block_table[pos // BS], pos % BS)] == (ident, tuple(tokens[:pos + 1])), pos
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for item in out.scheduled:
            if item.samples:
                seq = item.seq
                seq.output_token_ids.append(rng.randrange(1000))
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens:
                    sched.finish(seq, "length")
                    finished += 1
        live = list(sched.running) + list(sched.waiting)
        if live and rng.random() < 0.1:
            sched.finish(rng.choice(live), "abort")
            aborted += 1
        steps += 1
        assert steps < 100_000
    assert finished + aborted == 1000
    assert bm.num_free_blocks == bm.num_blocks and not bm._chains
    assert all(bm.refcount(b) == 0 for b in range(bm.num_blocks))
    hits = sum(c.hits for c in sched.prefix_cache_counts.values())
    assert hits > 0 and sched.num_preemptions > 0 and cancelled > 0 and bm.num_evictions > 0, \
        "the run was meant to reuse blocks, evict, preempt and cancel steps"
