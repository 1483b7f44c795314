"""The adapter readers (loraserve.lora.reader): the reader process packs exactly what the thread reader packs,
gives every validation error with the same message and logs the same warnings; a reader process that dies is
replaced, one that can't start or hangs fails the read with a clear error, reads from several threads run in
reader processes of their own, and closing or dropping the reader ends its processes. Through an engine (CPU, process reader): adapters from a lora root serve the same tokens,
a broken one fails alone, and `close()` ends the reader process."""
from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest
import torch
from model_fixtures import make_lora_adapters
from test_lora_adapter import (CONFIG, SAFETENSORS, base, edit_config, edit_tensors, key_of,  # noqa: F401 (fixture)
                               save_lora, save_peft, spec_of, tiny_llama)

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine
from loraserve.lora import reader as reader_module
from loraserve.lora.adapter import LoRAAdapterError
from loraserve.lora.host_arena import HostArena
from loraserve.lora.pool import AdapterPacker, PageLayout
from loraserve.lora.reader import AdapterReaderError, ProcessReader, ReaderSetup, ThreadReader, make_reader
from loraserve.models.lora_spec import LoRAModelSpec

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the reader process needs memfd (Linux)")

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def setup_for(spec: LoRAModelSpec, max_lora_rank: int = 16, dtype=torch.bfloat16) -> ReaderSetup:
    """A reader setup for a Llama-shaped spec: packed q/k/v, o, gate/up and down layers, as the runtime has."""
    packed = [("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)),
              ("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))]
    layers, keys = [], []
    for layer in range(spec.num_layers):
        for attr, names in packed:
            widths = [spec.modules[n][1] for n in names]
            offsets = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
            layers.append((attr, spec.modules[names[0]][0], offsets[-1], offsets))
            keys.append((layer, names))
    return ReaderSetup(spec, max_lora_rank, AdapterPacker(PageLayout(layers), tuple(keys), dtype))


@pytest.fixture(scope="module")
def spec(base):  # noqa: F811 (the imported fixture)
    return spec_of(base, model_name="acme/tiny-llama")


@pytest.fixture(scope="module")
def readers(spec):
    """(thread reader, process reader) of the same setup; the process reader is closed at the end."""
    setup = setup_for(spec)
    process = ProcessReader(setup, host=None)
    yield ThreadReader(setup, host=None), process
    process.close()


def read_both(readers, name, folder):
    """The two readers' results (or errors) for one folder."""
    results = []
    for reader in readers:
        try:
            results.append(reader.read(name, folder))
        except LoRAAdapterError as exc:
            results.append(exc)
    return results


def test_the_process_packs_what_the_thread_packs(base, readers, tmp_path):  # noqa: F811
    cases = {"all": dict(r=16, lora_alpha=32, target_modules=list(MODULES)),
             "qv-r5": dict(r=5, lora_alpha=7, target_modules=["q_proj", "v_proj"]),
             "mlp-patterns": dict(r=8, lora_alpha=16, target_modules=["up_proj", "down_proj"],
                                  rank_pattern={"down_proj": 12})}
    for name, kwargs in cases.items():
        thread, process = read_both(readers, name, save_lora(base, tmp_path / name, **kwargs))
        assert process.rank == thread.rank == max([kwargs["r"], *kwargs.get("rank_pattern", {}).values()])
        assert process.packed.row_blocks == thread.packed.row_blocks
        assert torch.equal(process.packed.ranks, thread.packed.ranks)
        assert process.packed.data.dtype == thread.packed.data.dtype == torch.bfloat16
        assert torch.equal(process.packed.data, thread.packed.data) and thread.packed.data.abs().sum() > 0
        assert process.seconds > 0
        for loaded in (thread, process):  # where the time went: three non-negative parts of it
            parts = (loaded.phases.files, loaded.phases.range_wait, loaded.phases.pack)
            assert loaded.phases.files > 0 and min(parts) >= 0 and sum(parts) <= loaded.seconds + 1e-6
        assert thread.phases.range_wait == 0.0


def broken_folders(base, tmp_path) -> dict[str, str]:  # noqa: F811
    """One folder per validation error of lora/adapter.py and lora/peft_config.py that a file can cause."""
    from peft import IA3Config, LoraConfig

    made = {"no folder": str(tmp_path / "nope")}

    def lora(name, **kwargs):
        made[name] = save_lora(base, tmp_path / name.replace(" ", "-"), **kwargs)
        return made[name]

    os.remove(os.path.join(lora("no config"), CONFIG))
    os.remove(os.path.join(lora("no weights"), SAFETENSORS))
    path = os.path.join(lora("cut safetensors"), SAFETENSORS)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    made["cut bin"] = save_peft(base, tmp_path / "bin", LoraConfig(init_lora_weights=False, r=4,
                                                                     target_modules=["q_proj"]), safe=False)
    path = os.path.join(made["cut bin"], "adapter_model.bin")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    with open(os.path.join(lora("invalid json"), CONFIG), "w") as f:
        f.write("{not json")
    lora("rank above max", r=32, target_modules=["v_proj"])
    edit_config(lora("unknown target"), target_modules=["q_proj", "foo_proj"])
    edit_tensors(lora("foreign tensor"), lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.randn(4, 64),
        "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.randn(64, 4)}))
    made["wider model"] = save_lora(tiny_llama(intermediate_size=256), tmp_path / "wider", target_modules=["down_proj"])
    for part, value in (("A", float("nan")), ("B", float("inf"))):
        edit_tensors(lora(f"non-finite {part}", target_modules=["up_proj"]),
                     lambda t, part=part, value=value: t[key_of(t, "layers.1.mlp.up_proj", part)].__setitem__(
                         (1, 2), value))
    edit_tensors(lora("no B", target_modules=["k_proj"]),
                 lambda t: t.pop(key_of(t, "layers.1.self_attn.k_proj", "B")))
    edit_config(lora("rank disagrees", r=4, target_modules=["k_proj"]), r=8)
    edit_config(lora("untargeted"), layers_to_transform=[0])
    lora("dora", use_dora=True)
    edit_config(lora("hidden modules_to_save", modules_to_save=["lm_head"]), modules_to_save=None)
    made["ia3"] = save_peft(base, tmp_path / "ia3", IA3Config(target_modules=["k_proj", "down_proj"],
                                                               feedforward_modules=["down_proj"]))
    return made


def test_every_validation_error_comes_back_the_same(base, readers, tmp_path):  # noqa: F811
    for case, folder in broken_folders(base, tmp_path).items():
        thread, process = read_both(readers, "bad", folder)
        assert isinstance(thread, LoRAAdapterError), (case, thread)
        assert type(process) is type(thread), (case, process)
        assert (str(process), process.adapter, process.problem, process.module) == \
            (str(thread), thread.adapter, thread.problem, thread.module), case
    assert readers[1].read("fine", save_lora(base, tmp_path / "fine")).rank == 4  # the reader goes on


def test_the_reader_process_logs_its_warnings_here(base, readers, tmp_path, caplog):  # noqa: F811
    folder = save_lora(base, tmp_path)
    edit_config(folder, base_model_name_or_path="acme/other-model")
    with caplog.at_level(logging.WARNING, logger="loraserve"):
        readers[1].read("w", folder)
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.name == "loraserve.lora.adapter"
    assert "'w'" in record.getMessage() and "acme/other-model" in record.getMessage()


def test_a_dead_reader_process_is_replaced(base, spec, tmp_path):  # noqa: F811
    folder = save_lora(base, tmp_path)
    reader = ProcessReader(setup_for(spec), host=None)
    try:
        first = reader.read("a", folder)
        old = reader.processes[0]
        old.kill()
        old.wait()
        again = reader.read("a", folder)  # the send or the reply finds it dead: a new one reads it
        assert reader.pid not in (None, old.pid)
        assert torch.equal(again.packed.data, first.packed.data)
    finally:
        reader.close()


def test_a_reader_process_that_cannot_start_or_hangs_fails_the_read(base, spec, tmp_path, monkeypatch):  # noqa: F811
    folder = save_lora(base, tmp_path)
    monkeypatch.setattr(reader_module.sys, "executable", "/bin/false")  # it exits at once, twice
    reader = ProcessReader(setup_for(spec), host=None)
    with pytest.raises(AdapterReaderError, match=r"LoRA adapter 'a': can't be read: .*exited \(exit code 1\) "
                                                 r"while starting"):
        reader.read("a", folder)
    reader.close()
    monkeypatch.undo()

    class Hang:  # unpickling it in the reader process sleeps: the reader never says it is ready
        def __reduce__(self):
            return time.sleep, (3600,)

    monkeypatch.setattr(reader_module, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(reader_module, "_POLL_S", 0.05)
    setup = setup_for(spec)
    hanging = ProcessReader(ReaderSetup(Hang(), setup.max_lora_rank, setup.packer), host=None)
    proc = hanging.processes[0]
    with pytest.raises(AdapterReaderError, match="took over 1 s starting and was stopped"):
        hanging.read("a", folder)
    assert proc.poll() is not None  # stopped, not left behind
    with pytest.raises(AdapterReaderError, match="closed"):
        hanging.close() or hanging.read("a", folder)


def test_reads_from_several_threads_run_side_by_side_in_processes_of_their_own(base, spec, tmp_path):  # noqa: F811
    """Two reads at once (each thread held inside the read until the other has started its own) run in the
    reader's two processes, with the results the thread reader gives; close ends both."""
    folder = save_lora(base, tmp_path)
    reader = ProcessReader(setup_for(spec), host=None, processes=2)
    expected = ThreadReader(setup_for(spec), host=None).read("a", folder).packed.data
    try:
        inside = threading.Barrier(2, timeout=60)
        original = reader._read

        def read_meeting_the_other(slot, name, path):
            inside.wait()  # both reads hold a reader process before either reads
            return original(slot, name, path)

        reader._read = read_meeting_the_other
        results = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, reader.read(f"t{i}", folder)))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert all(torch.equal(r.packed.data, expected) for r in results)
        procs = reader.processes
        assert len(procs) == 2 and len({p.pid for p in procs}) == 2
    finally:
        reader.close()
    assert all(p.poll() is not None for p in procs)


def test_close_and_collection_end_the_reader_process(spec):
    reader = ProcessReader(setup_for(spec), host=None)
    proc = reader.processes[0]
    reader.close()
    assert proc.poll() is not None
    dropped = ProcessReader(setup_for(spec), host=None)
    proc = dropped.processes[0]
    del dropped
    gc.collect()
    assert proc.wait(timeout=5) is not None


def test_make_reader_picks_the_process_only_where_there_is_a_host_arena(spec):
    setup = setup_for(spec)
    assert isinstance(make_reader("auto", setup, host=None), ThreadReader)
    assert isinstance(make_reader("thread", setup, host=HostArena(2**20, pin=False)), ThreadReader)
    process = make_reader("process", setup, host=None)
    assert isinstance(process, ProcessReader)
    process.close()
    with pytest.raises(ValueError, match="lora reader must be one of"):
        make_reader("fork", setup, host=None)


def test_reader_processes_pack_straight_into_a_shared_arena(base, spec, tmp_path):  # noqa: F811
    """With a shared host arena the reader processes pack into ranges of it (the engine's process copies
    nothing): the pages and ranks equal the thread reader's, also in a range used before (zeroed first: a
    smaller adapter after a bigger one), and a read that finds no room arrives in its own memory, equal too."""
    big = save_lora(base, tmp_path / "big", r=16, target_modules=list(MODULES))
    small = save_lora(base, tmp_path / "small", r=4, target_modules=["q_proj", "down_proj"])
    setup = setup_for(spec)
    thread = ThreadReader(setup, host=None)
    expected = {folder: thread.read("x", folder).packed for folder in (big, small)}
    one = expected[big].data.numel() * expected[big].data.element_size() + 4096  # a big adapter's range at most
    host = HostArena(2 * one, pin=False, shared=True)
    process = ProcessReader(setup, host, processes=2)

    def in_arena(packed):
        return 0 <= host.offset_of(packed.data) < host.nbytes and 0 <= host.offset_of(packed.ranks) < host.nbytes

    try:
        loaded = process.read("a", big)
        first = loaded.packed
        assert in_arena(first)
        # the reader process waited for this process to give it a range, within the read's time
        assert 0 < loaded.phases.range_wait < loaded.seconds and loaded.phases.pack > 0
        assert torch.equal(first.data, expected[big].data) and torch.equal(first.ranks, expected[big].ranks)
        host.give_back(first.data)
        held = []
        for folder in (small, big):  # the small one where the first big one was, the second big one after it
            held.append(process.read("b", folder).packed)
            assert torch.equal(held[-1].data, expected[folder].data)
            assert torch.equal(held[-1].ranks, expected[folder].ranks) and in_arena(held[-1])
        held.append(process.read("c", big).packed)
        assert not in_arena(held[-1])  # no room left: its own memory
        assert torch.equal(held[-1].data, expected[big].data) and torch.equal(held[-1].ranks, expected[big].ranks)
    finally:
        process.close()


def test_a_reader_process_that_dies_while_packing_into_the_arena_gives_its_range_back(base, spec, tmp_path):  # noqa: F811
    """The reader process is killed once it has a range of the shared arena: the read is tried again in a new
    process, and the dead one's range returns to the arena (only the result's range stays taken)."""
    folder = save_lora(base, tmp_path, r=16, target_modules=list(MODULES))
    setup = setup_for(spec)
    expected = ThreadReader(setup, host=None).read("x", folder).packed
    host = HostArena(4 * expected.data.numel() * expected.data.element_size(), pin=False, shared=True)
    reader = ProcessReader(setup, host)
    take, kills = host.take_packed, []

    def take_then_kill(*args):
        taken = take(*args)
        if not kills:  # the first read's process dies holding the range
            kills.append(reader.processes[0])
            kills[0].kill()
            kills[0].wait()
        return taken

    host.take_packed = take_then_kill
    try:
        got = reader.read("a", folder).packed
        assert kills and reader.pid not in (None, kills[0].pid)
        assert torch.equal(got.data, expected.data) and torch.equal(got.ranks, expected.ranks)
        host.give_back(got.data)
        assert host.free_bytes == host.nbytes  # nothing left taken by the dead process's read
    finally:
        reader.close()


@pytest.mark.gpu
def test_pinned_reads_on_cuda(base, spec, tmp_path):  # noqa: F811
    """With a pinned host arena (shared and registered with CUDA, as the runtime makes it), the reader process's
    and the thread's pages arrive in it, equal."""
    folder = save_lora(base, tmp_path, r=16, target_modules=list(MODULES))
    setup = setup_for(spec)
    host = HostArena(2**24, shared=True)
    process = make_reader("auto", setup, host)
    try:
        assert isinstance(process, ProcessReader)
        got, expected = process.read("a", folder), ThreadReader(setup, host).read("a", folder)
    finally:
        process.close()
    for packed in (got.packed, expected.packed):
        assert packed.data.is_pinned() and packed.ranks.is_pinned()
        assert packed.data.data_ptr() - host._base in host._owners
    assert torch.equal(got.packed.data, expected.packed.data) and torch.equal(got.packed.ranks, expected.packed.ranks)


# -- through the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    folder = tmp_path_factory.mktemp("reader-root")
    make_lora_adapters(model, folder, [{"name": "sql", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                                       {"name": "chat", "r": 8, "target_modules": ["o_proj", "down_proj"]}])
    broken = folder / "broken"
    broken.mkdir()
    (broken / CONFIG).write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    (broken / SAFETENSORS).write_bytes(b"not safetensors")
    return model, str(folder)


def test_an_engine_with_the_reader_process_serves_the_same_tokens(root):
    model, folder = root
    common = dict(device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16, lora_root=folder)
    threads = LLM(model, lora_reader="thread", **common)
    process = LLM(model, lora_reader="process", **common)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}] * 3
    loras = [LoRARequest("sql"), LoRARequest("chat"), None]
    expected = [o.outputs[0].token_ids for o in threads.generate(prompts, GREEDY, loras, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in process.generate(prompts, GREEDY, loras, use_tqdm=False)]
    assert got == expected and expected[0] != expected[2] and expected[1] != expected[2]
    with pytest.raises(LoRAAdapterError, match="'broken'.*cannot read adapter_model.safetensors"):
        process.generate(prompts[0], GREEDY, LoRARequest("broken"), use_tqdm=False)
    proc = process.engine.lora_manager.reader.processes[0]
    process.engine.shutdown()
    assert proc.poll() is not None


def test_add_request_reads_a_new_adapter_in_the_background(root):
    """LLMEngine.add_request returns before the adapter is read; the request waits for it while others run, and
    a broken adapter fails its requests alone (their outputs carry the error)."""
    model, folder = root
    engine = LLMEngine.from_args(EngineArgs(model, device="cpu", max_model_len=64, enable_lora=True,
                                            max_lora_rank=16, lora_root=folder, lora_reader="process"))
    try:
        engine.add_request("base", [5, 6, 7, 8], GREEDY)
        engine.step()
        for rid, name in (("sql-1", "sql"), ("sql-2", "sql"), ("bad", "broken"), ("gone", "chat")):
            engine.add_request(rid, [5, 6, 7, 8], GREEDY, LoRARequest(name))
        assert engine.list_loras() == []  # nothing read on this thread
        engine.abort_request("gone")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert set(done) == {"base", "sql-1", "sql-2", "bad"}
        assert "cannot read adapter_model.safetensors" in done["bad"].error
        assert done["bad"].outputs[0].finish_reason == "abort" and not done["bad"].outputs[0].token_ids
        assert done["sql-1"].error is None and len(done["sql-1"].outputs[0].token_ids) == GREEDY.max_tokens
        assert done["sql-1"].outputs[0].token_ids == done["sql-2"].outputs[0].token_ids
        assert sorted(engine.list_loras()) == ["chat", "sql"]  # the aborted request's adapter was read anyway
        phases = list(engine.lora_manager.recent_read_phases)  # one per adapter read from disk
        assert len(phases) == len(engine.lora_manager.recent_load_seconds) == 2 and all(p.files > 0 for p in phases)
        assert not engine.lora_manager.refcounts
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()
