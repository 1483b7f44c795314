"""Adapter reads beside a decoding engine: the engine thread's step times while adapter folders are read, checked
and packed beside it, by the thread reader (in the engine's process, as when the engine reads on a thread) and by
the reader process (loraserve/lora/reader.py), against no reads at all.

An engine of --model (default synthetic:tiny, whose steps are nearly all host work, as the host side of a GPU
decode step is) decodes --requests requests; beside it a reader reads PEFT folders of --adapter-model (default
synthetic:llama-3-8b: rank --rank on all seven projections, 84 MB in bf16) one after another, as long as the
phase lasts. The adapter model is built on the meta device: only its LoRA shapes and page layout are used. Each
phase ("alone", "thread", "process", in turn, twice) times --steps engine steps; the report gives their p50/p90/p99, the ratio
to "alone", and the reads done with their median time. No target: the cold-start benchmark measures what
users see on a GPU; this one shows, on any machine, what reading adapters costs the engine thread.

    python benchmarks/adapter_reads.py --device cpu --out /tmp/bench/adapter_reads
    python benchmarks/adapter_reads.py --device cpu --quick --out /tmp/b
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import SamplingParams  # noqa: E402
from loraserve.config import EngineArgs, LoRAConfig  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.reader import ProcessReader, ReaderSetup, ThreadReader  # noqa: E402
from loraserve.lora.runtime import LoRARuntime  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402
from loraserve.models.loader import build_empty_model  # noqa: E402
from loraserve.models.synthetic import synthetic_config  # noqa: E402

PHASES = ("alone", "thread", "process")
ROUNDS = 2  # the phases run in turn this many times (the machine's load drifts); the steps of a phase are pooled


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:tiny")
    p.add_argument("--adapter-model", default=None,
                   help="synthetic:NAME whose adapters are read (default synthetic:llama-3-8b; --quick: tiny)")
    p.add_argument("--rank", type=int, default=16, help="rank of the adapters read")
    p.add_argument("--requests", type=int, default=8, help="requests the engine decodes")
    p.add_argument("--steps", type=int, default=None, help="timed engine steps per phase (default 2000; --quick 40)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine's process (default 1: its steps are host work, as on a GPU)")
    args = p.parse_args(argv)
    args.adapter_model = args.adapter_model or ("synthetic:tiny" if args.quick else "synthetic:llama-3-8b")
    args.steps = args.steps or (40 if args.quick else 2000)
    if not args.adapter_model.startswith("synthetic:"):
        p.error("--adapter-model must be synthetic:NAME")
    return args


def reader_setup(adapter_model: str, rank: int) -> ReaderSetup:
    """The reader setup of an engine serving `adapter_model` (LoRA shapes and page layout; no weights)."""
    config = synthetic_config(adapter_model.split(":", 1)[1])
    model = build_empty_model(config, torch.device("meta"), torch.bfloat16)
    runtime = LoRARuntime(model, LoRAConfig(max_loras=1, max_lora_rank=rank), 1, adapter_model)
    return ReaderSetup(runtime.spec, rank, runtime.packer)


class Reads:
    """Reads the folders one after another on a thread until stopped; records each read's seconds."""

    def __init__(self, reader, folders: list[str]):
        self.reader, self.folders = reader, folders
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-reads", daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.seconds.append(self.reader.read(f"a{i}", self.folders[i % len(self.folders)]).seconds)
            i += 1

    def __enter__(self) -> "Reads":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def time_steps(engine: LLMEngine, args, rng) -> list[float]:
    """Seconds of each of --steps engine steps, after a few untimed ones, with --requests requests decoding."""
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0.0)
    vocab = engine.hf_config.vocab_size
    for i in range(args.requests):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", rng.integers(0, vocab, 16).tolist(), params)
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_args(EngineArgs(args.model, device=device, dtype=args.dtype, max_model_len=args.steps + 64,
                                            max_num_seqs=args.requests, seed=args.seed))
    setup = reader_setup(args.adapter_model, args.rank)
    report = {"benchmark": "adapter_reads", "args": vars(args), "env": bc.environment(device), "phases": {}}
    with tempfile.TemporaryDirectory(prefix="adapter-reads-") as root:
        folders = []
        for i in range(2):
            adapter = random_adapter(setup.spec, f"w{i}", args.rank, seed=args.seed + i).to(dtype=torch.bfloat16)
            folders.append(os.path.join(root, f"w{i}"))
            bc.write_peft_folder(folders[-1], adapter, args.rank)
            del adapter
        readers = {"thread": ThreadReader(setup, None), "process": ProcessReader(setup, None)}
        for reader in readers.values():  # the reader process started, and the files in the page cache
            megabytes = [reader.read("warm", folder).packed.nbytes / 2**20 for folder in folders][0]
        times = {phase: ([], []) for phase in PHASES}  # phase -> (step seconds, read seconds)
        time_steps(engine, args, rng)  # untimed: the first steps of a process are slower
        for _ in range(ROUNDS):
            for phase in PHASES:
                steps, seconds = times[phase]
                if phase == "alone":
                    steps += time_steps(engine, args, rng)
                    continue
                with Reads(readers[phase], folders) as reads:
                    steps += time_steps(engine, args, rng)
                seconds += reads.seconds
        for phase, (steps, seconds) in times.items():
            report["phases"][phase] = {"step_s": bc.percentiles(steps), "reads": len(seconds),
                                       "read_s": bc.percentiles(seconds)}
        readers["process"].close()
    alone = report["phases"]["alone"]["step_s"]
    rows = []
    for phase, run in report["phases"].items():
        step = run["step_s"]
        run["vs_alone"] = {k: step[k] / alone[k] for k in step}
        rows.append([phase, 1e3 * step["p50"], 1e3 * step["p90"], 1e3 * step["p99"], run["vs_alone"]["p50"],
                     run["vs_alone"]["p99"], run["reads"], run["read_s"]["p50"]])
    print(f"{args.model} decoding {args.requests} requests on {device}; beside it, {args.adapter_model} adapters of "
          f"rank {args.rank} ({megabytes:.1f} MB packed) read one after another:")
    bc.print_table(["phase", "step p50 ms", "p90 ms", "p99 ms", "p50 / alone", "p99 / alone", "reads",
                    "read s p50"], rows)
    bc.write_json(args.out, "adapter_reads.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
