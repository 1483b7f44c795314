"""`loraserve bench NAME --quick` runs benchmarks/<script> with the flags after NAME, for the benchmarks whose
--quick runs on the CPU (their tests: tests/test_*_bench.py)."""
import sys
from pathlib import Path

import pytest

from loraserve.entrypoints import cli

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name, script", [("many-adapters", "many_adapters.py"), ("prefix-cache", "prefix_cache.py"),
                                          ("cold-start", "cold_start.py"), ("adapter-reads", "adapter_reads.py")])
def test_cli_runs_the_script(monkeypatch, name, script):
    ran = []
    monkeypatch.setattr(cli.runpy, "run_path", lambda path, run_name: ran.append((path, list(sys.argv[1:]))))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["bench", name, "--quick"]) == 0
    assert ran == [(str(BENCHMARKS / script), ["--quick"])]
