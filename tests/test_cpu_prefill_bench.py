"""benchmarks/cpu_prefill.py on a tiny HF model: both engines run the prompt and the report has both times."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_prefill  # noqa: E402 (the benchmark under test)


def test_cpu_prefill_tiny(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    assert cpu_prefill.main(["--model", model, "--prompt-len", "100", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_prefill.json").read_text())
    assert report["loraserve_s"] > 0 and report["hf_s"] > 0
    assert report["ratio"] == report["loraserve_s"] / report["hf_s"]
