"""Scheduler and block manager: invariants under random load, aborts, preemption and adapter limits (prefix
caching on, as by default: the prompts here share their first tokens)."""
import random
from collections import Counter

import pytest

from loraserve.config import LoRAConfig, SchedulerConfig
from loraserve.engine.block_manager import BlockManager
from loraserve.sequence import Sequence, SequenceStatus
from loraserve.engine.scheduler import Scheduler
from loraserve.sampling_params import SamplingParams


class FakeRoom:
    """The GPU adapter pool as the scheduler sees it: `num_pages` pages, each adapter's pages (default 1), an
    identity per adapter (a test sets `identities[name]` to stand for the adapter's files read again)."""

    def __init__(self, num_pages=10_000, pages=None, pinned=()):
        self.num_pages = num_pages
        self._pages = dict(pages or {})
        self.pinned = frozenset(pinned)
        self.identities = {}
        self.unread = set()  # adapters still being read (not ready)

    def pages_of(self, name):
        return self._pages.get(name, 1)

    def identity(self, name):
        return self.identities.setdefault(name, len(self.identities))

    def is_ready(self, name):
        return name not in self.unread


def _seq(i, prompt_len, max_tokens, lora=None):
    return Sequence(f"r{i}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), i, lora)


def _check_invariants(sched: Scheduler, out, config: SchedulerConfig, max_loras: int):
    bm = sched.block_manager
    owned = Counter(b for s in list(sched.running) + list(sched.waiting) for b in s.block_table)
    assert all(bm.refcount(b) == n for b, n in owned.items()), "a block's holders and its refcount differ"
    assert len(owned) + bm.num_free_blocks == bm.num_blocks, "blocks leaked or double-freed"
    computed = {item.seq: item.seq.num_computed_tokens + item.num_new_tokens for item in out.scheduled}
    for s in sched.running:  # a shared block is full and computed by the end of this step
        for i, b in enumerate(s.block_table):
            assert owned[b] == 1 or (i + 1) * bm.block_size <= computed.get(s, s.num_computed_tokens)
    assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    assert out.num_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    active = {s.lora_name for s in sched.running if s.lora_name}
    assert len(active) <= max_loras
    room = sched._room
    if room is not None:
        assert sum(room.pages_of(n) for n in active | room.pinned) <= room.num_pages, "adapters overflow the pool"
    for item in out.scheduled:
        s = item.seq
        assert s.status is SequenceStatus.RUNNING
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + item.num_new_tokens


def _complete_step(sched: Scheduler, out, rng, finished):
    for item in out.scheduled:
        seq = item.seq
        samples = item.samples
        seq.num_computed_tokens += item.num_new_tokens
        if samples:
            seq.output_token_ids.append(rng.randrange(1000))
            if len(seq.output_token_ids) >= seq.sampling_params.max_tokens:
                sched.finish(seq, "length")
                finished.append(seq)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_requests_with_aborts_leak_no_blocks(seed):
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    bm = BlockManager(num_blocks=40, block_size=8)
    sched = Scheduler(config, bm, LoRAConfig(max_loras=2), FakeRoom())
    pending = [_seq(i, rng.randint(1, 100), rng.randint(1, 40), rng.choice([None, "a", "b", "c", "d"]))
               for i in range(1000)]
    finished, aborted, steps = [], [], 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 8)):
            if pending:
                sched.add(pending.pop())
        out = sched.schedule()
        _check_invariants(sched, out, config, 2)
        _complete_step(sched, out, rng, finished)
        live = list(sched.running) + list(sched.waiting)
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            sched.finish(victim, "abort")
            aborted.append(victim)
        steps += 1
        assert steps < 100_000
    assert len(finished) + len(aborted) == 1000
    assert bm.num_free_blocks == bm.num_blocks
    assert all(len(s.output_token_ids) == s.sampling_params.max_tokens for s in finished)


def test_preemption_under_tiny_kv_budget_completes_everything():
    rng = random.Random(3)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    bm = BlockManager(num_blocks=10, block_size=8)  # 80 tokens: a few sequences at most
    sched = Scheduler(config, bm, LoRAConfig(max_loras=4), FakeRoom())
    seqs = [_seq(i, rng.randint(5, 30), rng.randint(5, 30)) for i in range(30)]
    for s in seqs:
        sched.add(s)
    finished, preempted = [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        _check_invariants(sched, out, config, 4)
        _complete_step(sched, out, rng, finished)
    assert preempted > 0, "the budget was meant to force preemption"
    assert len(finished) == 30 and bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_respects_token_budget():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=1), FakeRoom())
    seq = _seq(0, 50, 2)
    sched.add(seq)
    chunks = []
    while True:
        item = sched.schedule().scheduled[0]
        chunks.append(item.num_new_tokens)
        if item.samples:
            break
        seq.num_computed_tokens += item.num_new_tokens
    assert chunks == [16, 16, 16, 2]


def test_a_request_without_a_slot_never_blocks_the_requests_behind_it():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=1), FakeRoom())
    a, b, a2, base = _seq(0, 4, 4, "a"), _seq(1, 4, 4, "b"), _seq(2, 4, 4, "a"), _seq(3, 4, 4)
    for s in (a, b, a2, base):
        sched.add(s)
    out = sched.schedule()
    ran = {item.seq.request_id for item in out.scheduled}
    # "b" can't get the one slot; "a2" (its adapter runs) and the base request pass it
    assert ran == {"r0", "r2", "r3"}
    sched.finish(a, "stop")
    assert "r1" not in {item.seq.request_id for item in sched.schedule().scheduled}  # "a2" still holds the slot
    sched.finish(a2, "stop")
    assert "r1" in {item.seq.request_id for item in sched.schedule().scheduled}


def test_pinned_adapters_take_slots():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=2), FakeRoom(pinned={"p"}))
    sched.add(_seq(0, 4, 4, "a"))
    sched.add(_seq(1, 4, 4, "b"))
    sched.add(_seq(2, 4, 4, "p"))
    ran = {item.seq.request_id for item in sched.schedule().scheduled}
    # "b" would need a third slot (the pinned adapter holds one); "p" needs no new slot, so it may pass
    assert ran == {"r0", "r2"}


def test_block_manager_allocate_and_free():
    bm = BlockManager(4, 16)
    s = _seq(0, 10, 1)
    assert bm.blocks_needed(s, 33) == 3
    bm.allocate(s, 33)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(s, 65) and bm.can_allocate(s, 64)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 80)
    bm.free(s)
    assert bm.num_free_blocks == 4 and s.block_table == []


def _run_to_completion(sched: Scheduler, config: SchedulerConfig, max_loras: int, arrivals=None):
    """Step until every request finishes, each step completing its sequences' tokens; arrivals: step ->
    sequences added before that step. Returns the number of steps and the step each request first ran."""
    rng, finished, first_run, step = random.Random(0), [], {}, 0
    arrivals = arrivals or {}
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        out = sched.schedule()
        _check_invariants(sched, out, config, max_loras)
        for item in out.scheduled:
            first_run.setdefault(item.seq.request_id, step)
        _complete_step(sched, out, rng, finished)
        step += 1
        assert step < 10_000
    return step, first_run


def test_many_adapters_over_few_slots_take_about_the_ideal_number_of_steps():
    """96 requests over 24 adapters (4 each, shuffled), 4 slots: the requests of the adapters that hold the
    slots run together, so the run takes about 6 rounds of one request's length, not one adapter group per
    request."""
    rng = random.Random(5)
    config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, BlockManager(400, 8), LoRAConfig(max_loras=4), FakeRoom())
    seqs = [_seq(i, 4, 8, f"a{i % 24}") for i in range(96)]
    rng.shuffle(seqs)
    for seq in seqs:
        sched.add(seq)
    steps, _ = _run_to_completion(sched, config, 4)
    ideal = (24 // 4) * 8  # 6 rounds of 4 adapters, 8 steps each (a one-step prefill, then 7 decodes)
    assert steps <= 1.25 * ideal, f"{steps} steps, ideal {ideal}"


def test_a_cold_adapter_behind_a_hot_flood_gets_a_slot_in_bounded_steps():
    """Two slots held by two hot adapters whose new requests arrive every step: a request for a third
    adapter still runs within about max_wait_steps plus one hot request's length."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=64)
    lora = LoRAConfig(max_loras=2, max_wait_steps=8)
    sched = Scheduler(config, BlockManager(2000, 8), lora, FakeRoom())
    flood_steps, max_tokens = 60, 10
    arrivals = {t: [_seq(1000 + 2 * t, 4, max_tokens, "h0"), _seq(1001 + 2 * t, 4, max_tokens, "h1")]
                for t in range(flood_steps)}
    arrivals[5].append(_seq(0, 4, max_tokens, "cold"))
    _, first_run = _run_to_completion(sched, config, 2, arrivals)
    waited = first_run["r0"] - 5
    assert waited <= lora.max_wait_steps + max_tokens + 2, f"the cold request waited {waited} steps"
    assert len(first_run) == 2 * flood_steps + 1  # and every request ran


def test_pinned_adapters_are_never_drained():
    """With the only unpinned slot taken by a hot adapter, a starving request drains that one, never the
    pinned adapter."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=64)
    lora = LoRAConfig(max_loras=2, max_wait_steps=4)
    sched = Scheduler(config, BlockManager(2000, 8), lora, FakeRoom(pinned={"p"}))
    arrivals = {t: [_seq(1000 + 2 * t, 4, 6, "p"), _seq(1001 + 2 * t, 4, 6, "hot")] for t in range(40)}
    arrivals[2].append(_seq(0, 4, 6, "cold"))
    _, first_run = _run_to_completion(sched, config, 2, arrivals)
    assert first_run["r0"] - 2 <= lora.max_wait_steps + 6 + 2
    p_steps = sorted(first_run[s.request_id] for t in range(40) for s in arrivals[t] if s.lora_name == "p")
    assert p_steps == list(range(40))  # every request of the pinned adapter ran in the step it arrived


def test_adapters_share_the_pool_by_their_pages():
    """A pool of 8 pages and adapters of 1, 2 and 4 pages (ranks 8, 16, 32): the running adapters never
    overflow it, small adapters are admitted past a big one that does not fit, and the big one runs
    within a bounded wait (the others drained for it); every request finishes."""
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=64)
    lora = LoRAConfig(max_loras=64, max_wait_steps=6)
    pages = {f"s{i}": 1 for i in range(6)} | {f"m{i}": 2 for i in range(3)} | {"big": 8}
    sched = Scheduler(config, BlockManager(4000, 8), lora, FakeRoom(num_pages=8, pages=pages))
    names = [f"s{i}" for i in range(6)] + [f"m{i}" for i in range(3)]
    arrivals = {t: [_seq(1000 + 10 * t + j, 4, 6, names[(t + j) % len(names)]) for j in range(3)]
                for t in range(40)}
    arrivals[3].append(_seq(0, 4, 6, "big"))
    _, first_run = _run_to_completion(sched, config, 64, arrivals)
    assert len(first_run) == 3 * 40 + 1
    assert first_run["r0"] - 3 <= lora.max_wait_steps + 6 + 2
    # the small adapters kept running while the big one could not fit
    assert any(first_run[s.request_id] == 3 for s in arrivals[3] if s.lora_name != "big")


def test_waiting_loras_lists_the_adapters_to_load_ahead():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=4), FakeRoom())
    for i, name in enumerate(["a", "b", "c", "c", "d", "b", "b"]):
        sched.add(_seq(i, 4, 4, name))
    ran = sched.schedule().scheduled  # one sequence at most: of "b", the adapter with the most requests
    assert [item.seq.request_id for item in ran] == ["r1"]
    assert sched.waiting_loras(limit=2) == ["c", "a"]  # "b" runs; "c" has two requests; "a" came before "d"
    assert sched.waiting_loras(limit=10) == ["c", "a", "d"]


def test_a_request_whose_adapter_is_being_read_never_blocks_the_requests_behind_it():
    """No step waits for a read: a request of an adapter not yet in the pool or the host cache is passed over
    (the requests behind it run) and admitted in the first step after its read is done."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    room = FakeRoom()
    room.unread = {"cold"}
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=4), room)
    for seq in (_seq(0, 4, 4, "cold"), _seq(1, 4, 4, "warm"), _seq(2, 4, 4)):
        sched.add(seq)
    assert {item.seq.request_id for item in sched.schedule().scheduled} == {"r1", "r2"}
    assert sched.waiting_loras(limit=4) == ["cold"]  # what the manager reads ahead
    assert "r0" not in {item.seq.request_id for item in sched.schedule().scheduled}  # still being read
    room.unread.clear()
    assert "r0" in {item.seq.request_id for item in sched.schedule().scheduled}


def test_the_starving_adapter_is_read_first():
    """Adapters are read ahead in waiting_loras' order: once the oldest waiting request has waited
    max_wait_steps, its adapter comes first there, before adapters with more waiting requests."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    room = FakeRoom()
    room.unread = {"old", "many"}
    sched = Scheduler(config, BlockManager(64, 8), LoRAConfig(max_loras=4, max_wait_steps=3), room)
    sched.add(_seq(0, 4, 4, "old"))
    for i in range(1, 4):
        sched.add(_seq(i, 4, 4, "many"))
    sched.schedule()
    assert sched.waiting_loras(limit=4) == ["many", "old"]  # the most waiting requests first
    for _ in range(3):
        sched.schedule()
    assert sched.waiting_loras(limit=4) == ["old", "many"]  # "old" has waited max_wait_steps
    assert sched.waiting_loras(limit=1) == ["old"]
