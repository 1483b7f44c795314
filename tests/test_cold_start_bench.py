"""benchmarks/cold_start.py on the CPU: the tiny model, --quick; the adapters it writes load as PEFT folders
and both windows record the running requests' latencies."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cold_start  # noqa: E402 (the benchmark under test)


def test_cold_start_quick(tmp_path):
    assert cold_start.main(["--model", "synthetic:tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cold_start.json").read_text())
    for variant in ("warm", "cold"):
        run = report["runs"][variant]
        start, end = run["window_s"]
        assert 0 < start < end
        assert run["hot_itls_in_window"] > 0
        assert run["hot_itl_s"]["p99"] >= run["hot_itl_s"]["p50"] > 0
    check = report["checks"][0]
    assert check["passed"] in (True, False) and "cold / warm" in check["name"]
