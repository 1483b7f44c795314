"""benchmarks/cold_start.py and benchmarks/adapter_reads.py on the CPU: the tiny model, --quick. The adapters
cold_start writes load as PEFT folders, both windows record the running requests' latencies, and the reader
process reads there; adapter_reads times the engine's steps alone and beside both readers."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import adapter_reads  # noqa: E402 (the benchmarks under test)
import cold_start  # noqa: E402


def test_cold_start_quick(tmp_path):
    assert cold_start.main(["--model", "synthetic:tiny", "--device", "cpu", "--quick", "--lora-reader", "process",
                            "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cold_start.json").read_text())
    assert report["lora_reader"] == "ProcessReader"
    assert report["runs"]["warm"]["read_s"] is None and report["runs"]["cold"]["read_s"]["p50"] > 0
    for variant in ("warm", "cold"):
        run = report["runs"][variant]
        start, end = run["window_s"]
        assert 0 < start < end
        assert run["hot_itls_in_window"] > 0
        assert run["hot_itl_s"]["p99"] >= run["hot_itl_s"]["p50"] > 0
    check = report["checks"][0]
    assert check["passed"] in (True, False) and "cold / warm" in check["name"]


def test_adapter_reads_quick(tmp_path):
    assert adapter_reads.main(["--device", "cpu", "--quick", "--steps", "20", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "adapter_reads.json").read_text())
    assert list(report["phases"]) == ["alone", "thread", "process"]
    for phase, run in report["phases"].items():
        assert run["step_s"]["p99"] >= run["step_s"]["p50"] > 0, phase
        assert run["vs_alone"]["p50"] > 0, phase
        assert (run["reads"] > 0) == (phase != "alone"), phase
    assert report["phases"]["alone"]["vs_alone"]["p50"] == 1.0
