"""benchmarks/prefix_cache.py on the CPU: the tiny model, --quick, 0 and 8 adapters with the prefix cache off
and on; the JSON has every reported field, and the prompt tokens computed add up."""
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import prefix_cache  # noqa: E402 (the benchmark under test)

RUN_FIELDS = ("adapters", "prefix_caching", "requests", "elapsed_s", "prompt_tokens", "shared_tokens",
              "prompt_tokens_computed", "output_tok_s", "ttft_s", "prefix_cache_queries", "prefix_cache_hits",
              "preemptions")


def test_prefix_cache_quick(tmp_path):
    assert prefix_cache.main(["--model", "synthetic:tiny", "--device", "cpu", "--quick", "--adapters", "0,8",
                              "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix_cache.json").read_text())
    runs = {(r["adapters"], r["prefix_caching"]): r for r in report["runs"]}
    assert set(runs) == {(0, False), (0, True), (8, False), (8, True)}
    n, system = report["args"]["num_requests"], report["args"]["system_len"]
    for key, r in runs.items():
        assert set(RUN_FIELDS) <= set(r), key
        assert r["requests"] == n and r["shared_tokens"] == n * system
        assert r["output_tok_s"] > 0 and r["ttft_s"]["p99"] >= r["ttft_s"]["p50"] > 0, key
        assert r["preemptions"] == 0, key
        assert r["prompt_tokens_computed"] == r["prompt_tokens"] - r["prefix_cache_hits"], key
    for adapters in (0, 8):
        assert runs[(adapters, False)]["prefix_cache_hits"] == runs[(adapters, False)]["prefix_cache_queries"] == 0
    assert runs[(0, True)]["prefix_cache_hits"] == (n - 1) * system  # only the first request computes it
    assert 0 < runs[(8, True)]["prefix_cache_hits"] < runs[(0, True)]["prefix_cache_hits"]  # once per adapter
    comparisons = report["comparisons"]
    assert abs(comparisons["0"]["shared_part_saved"] - (n - 1) / n) < 1e-9
    assert 0 < comparisons["8"]["shared_part_saved"] < comparisons["0"]["shared_part_saved"]
    assert [c["name"] for c in report["checks"]] == [
        "0 adapters: shared prompt part not computed with caching", "0 adapters: TTFT p50 off / on",
        "8 adapters: shared prompt part not computed with caching", "8 adapters: TTFT p50 off / on"]

