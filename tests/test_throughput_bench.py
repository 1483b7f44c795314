"""benchmarks/throughput.py on the CPU: the tiny model, --quick, base and LoRA engines; the JSON holds both runs,
and the last replay's time split by the kind of step accounts for its steps and its wall time."""
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import throughput  # noqa: E402 (the benchmark under test)


def test_throughput_quick_with_adapters(tmp_path, capsys):
    assert throughput.main(["--model", "synthetic:tiny", "--device", "cpu", "--quick", "--adapters", "3",
                            "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "throughput.json").read_text())["results"]
    assert list(results) == ["base", "lora"]
    for name, run in results.items():
        assert run["output_tok_s"] > 0 and run["engine_steps"] > 0, name
        split = run["step_seconds"]
        assert set(split) == set(throughput.STEP_KINDS), name
        # each engine step schedules once: decode rows only, with prompt tokens, or nothing (the step that finds
        # the last tokens, with async scheduling)
        assert sum(kind["calls"] for kind in split.values()) == run["engine_steps"], name
        assert split["prompt"]["calls"] >= 1 and split["decode"]["calls"] >= 1, name
        # the periods between schedule calls cover the replay, from its first schedule call to its end
        covered = sum(kind["seconds"] for kind in split.values())
        assert 0.5 * run["elapsed_s"] < covered <= run["elapsed_s"], name
    assert results["lora"]["adapters_resident"] == 3
    out = capsys.readouterr().out
    assert "decode-only steps" in out and "LoRA / base: output tok/s" in out
