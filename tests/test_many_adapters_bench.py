"""benchmarks/many_adapters.py on the CPU: the tiny model, --quick, a zipf and the fairness scenario; the JSON
has every reported field with plausible values."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import many_adapters  # noqa: E402 (the benchmark under test)

RUN_FIELDS = ("output_tok_s", "vs_base_tok_s", "engine_steps", "vs_base_steps", "mean_decode_batch",
              "vs_base_decode_batch", "mean_distinct_adapters", "floor", "achieved_vs_floor", "vs_base_floor",
              "h2d_adapter_bytes", "gpu_loads", "gpu_evictions", "pool_bytes_used_peak", "pool_bytes_total",
              "ttft_s", "itl_s", "finished", "requests", "decode_waves")


def test_many_adapters_quick(tmp_path):
    assert many_adapters.main(["--model", "synthetic:tiny", "--device", "cpu", "--quick",
                               "--scenarios", "8-zipf,fairness", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "many_adapters.json").read_text())
    runs = report["runs"]
    base_poisson = f"base-poisson-{many_adapters.FAIRNESS_RATE:g}"
    assert list(runs) == ["base", "8-zipf", base_poisson, "fairness"]  # fairness's own arrivals get a base run
    assert report["bandwidth_bytes_per_s"] > 0 and report["gemm_flop_per_s"] > 0
    for name, run in runs.items():
        assert set(RUN_FIELDS) <= set(run), name
        assert run["finished"] == run["requests"] == 32, name
        assert run["engine_steps"] > 0 and run["output_tok_s"] > 0, name
        assert 0 < run["mean_decode_batch"] <= 32, name
        assert 0 < run["achieved_vs_floor"] < 1.5, name
        floor = run["floor"]
        assert floor["floor_s"] >= max(floor["byte_floor_s"], floor["flop_floor_s"]) > 0, name
        assert floor["bytes"] == floor["weight_bytes"] + floor["kv_bytes"] + floor["adapter_bytes"], name
        assert run["ttft_s"]["all"]["p99"] >= run["ttft_s"]["all"]["p50"] > 0, name
        assert run["itl_s"]["p50"] > 0, name
        split = run["step_seconds"]  # the run's wall time between schedule calls, by kind of step
        assert split["decode"]["calls"] + split["prompt"]["calls"] == run["engine_steps"], name
        assert split["prompt"]["calls"] > 0 and split["decode"]["calls"] > 0, name
        seconds = sum(kind["seconds"] for kind in split.values())
        assert 0.9 * run["elapsed_s"] <= seconds <= 1.01 * run["elapsed_s"], name
        trace = run["step_trace"]  # per step: seconds, prompt tokens, decode rows, distinct adapters
        assert len(trace) == run["engine_steps"], name
        assert sum(step[0] for step in trace) == pytest.approx(seconds - split["idle"]["seconds"], rel=1e-3), name
        assert sum(1 for step in trace if step[1]) == split["prompt"]["calls"], name
        decode_periods = [step[0] for step in trace if not step[1]]  # the decode-only steps' periods
        assert split["decode"]["p50_s"] == pytest.approx(float(np.median(decode_periods)), rel=1e-3), name
        assert sum(step[1] for step in trace) >= 16 * run["requests"], name  # --quick prompts: 16-64 tokens
        assert all(step[2] <= 32 and step[3] <= 8 for step in trace), name
    base, zipf, fair = runs["base"], runs["8-zipf"], runs["fairness"]
    assert base["floor"]["adapter_bytes"] == 0 and base["mean_distinct_adapters"] == 0
    assert base["vs_base_steps"] == 1.0
    assert zipf["num_adapters"] == 8 and zipf["request_rate"] is None
    assert 1 <= zipf["mean_distinct_adapters"] <= 8
    assert zipf["gpu_loads"] >= 1 and zipf["h2d_adapter_bytes"] > 0 and zipf["floor"]["adapter_bytes"] > 0
    assert zipf["read_slots"] >= 1 and zipf["read_seconds_total"] >= zipf["read_seconds_p50"] > 0
    assert base["read_slots"] == 0 and base["read_seconds_total"] == 0
    phases = zipf["read_phases_p50"]  # medians of each part, each no more than the reads' median in all
    assert base["read_phases_p50"] is None and 0 < phases["files"] <= zipf["read_seconds_p50"]
    assert 0 <= phases["range_wait"] and 0 < phases["pack"] <= zipf["read_seconds_p50"]
    assert 0 < zipf["pool_bytes_used_peak"] <= zipf["pool_bytes_total"]
    assert {"hot", "cold"} <= set(zipf["ttft_s"])
    assert fair["request_rate"] == runs[base_poisson]["request_rate"] == many_adapters.FAIRNESS_RATE
    assert fair["base_run"] == base_poisson and zipf["base_run"] == "base"
    assert fair["vs_base_floor"] == fair["achieved_vs_floor"] / runs[base_poisson]["achieved_vs_floor"]
    assert fair["ttft_s"]["hot"]["requests"] + fair["ttft_s"]["cold"]["requests"] == 32
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["fairness: requests finished"]["passed"] is True
    assert checks["fairness: achieved/floor / base's"]["passed"] in (True, False)  # measured against its own base
    assert "fairness: cold p99 TTFT / hot p99 TTFT" in checks
    assert (tmp_path / "many_adapters.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_decode_waves():
    """Runs of decode-only steps with about the same distinct adapters, each step after a decode-only one; a prompt
    step, the step right after it and a jump in distinct adapters end a wave; runs shorter than WAVE_MIN_STEPS
    are left out."""
    n = many_adapters.WAVE_MIN_STEPS
    trace = ([[0.5, 4000, 0, 3]] + [[0.010, 0, 256, 3]] * (n + 1)  # prompt step, then a wave of 3 (its first after
             + [[0.012, 0, 256, 3 + many_adapters.WAVE_SPREAD + 1]] * n  # the prompt step is not decode-only)
             + [[0.3, 2000, 200, 9]] + [[0.2, 0, 256, 9]] + [[0.013, 0, 256, 9]] * (n - 1))  # too short
    adapter_bytes = [1000 * step[3] for step in trace]
    waves = many_adapters.decode_waves(trace, adapter_bytes, bandwidth=1e6)
    assert [w["steps"] for w in waves] == [n, n]  # the first wave's first step follows the prompt step
    assert [w["adapters"] for w in waves] == [3, 3 + many_adapters.WAVE_SPREAD + 1]
    assert [w["p50_s"] for w in waves] == [0.010, 0.012]
    assert waves[0]["adapter_bytes_s"] == 3000 / 1e6
