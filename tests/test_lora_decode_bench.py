"""benchmarks/lora_decode.py on the CPU: the tiny model, --quick, eager with adapters. Every case is timed with
its whole batch in each step (the adapters are made resident before the first step: a request otherwise waits
for its adapter's read) and the distinct adapters of a batch are the set's."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lora_decode  # noqa: E402 (the benchmark under test)


def test_lora_decode_quick(tmp_path):
    assert lora_decode.main(["--models", "synthetic:tiny", "--device", "cpu", "--quick", "--modes", "eager+lora",
                             "--adapter-sets", "0,4,mixed", "--batch-sizes", "4", "--capture-rounds", "0",
                             "--capture-max-loras", "", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora_decode.json").read_text())
    rows = {row["adapters"]: row for row in report["results"]}
    assert set(rows) == {"0", "4", "mixed"}
    for key, row in rows.items():
        assert "skipped" not in row, (key, row)
        assert row["itl_s"] > 0 and row["tok_s"] > 0
    assert rows["0"]["distinct_adapters"] == 0 and rows["4"]["distinct_adapters"] == 4
    assert rows["4"]["adapter_bytes"] > 0
