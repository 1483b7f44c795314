"""benchmarks/kernel_resources.py without a GPU: the programs-per-SM arithmetic, and the engine's decode launches
of the LoRA kernels compiled for sm_90 with ptxas's report read back."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import kernel_resources  # noqa: E402 (the benchmark under test)
from kernel_resources import Resources  # noqa: E402


def test_programs_per_sm():
    """Registers go to a warp in units of 256: 64 a thread is 2048 a warp, 8 programs of 4 warps; 72 a thread
    rounds up to 2304 a warp, 7 programs. Shared memory counts 1 KiB more per program; warps stop at 64."""
    assert Resources(64, 0, 5 * 1024, 4).programs_by() == {"registers": 8, "shared": 38, "warps": 16}
    assert Resources(72, 0, 17 * 1024, 4).programs_per_sm() == 7
    assert Resources(255, 0, 129 * 1024, 4).programs_by()["shared"] == 1
    assert Resources(32, 0, 0, 1).programs_by()["warps"] == 32  # at most 32 programs an SM, whatever their warps
    # a warp's registers come from one of 4 partitions of 16,384: 86 a thread is 2,816 a warp, 5 warps a partition,
    # 20 an SM: 10 programs of 2 warps (not 65,536 / 5,632 = 11)
    assert Resources(86, 0, 0, 2).programs_by()["registers"] == 10


@pytest.mark.slow
def test_decode_launches_compile():
    """The shrink and the delta expand of a 32-token q/k/v step, as the engine launches them, compile for sm_90
    (in a process of its own: the tests run the kernels in Triton's interpreter, which compiles nothing); each
    row reports the engine's 4 warps, a register count a thread can have and the programs an SM holds."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_resources.py"), "--layers", "qkv", "--tokens", "32"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("qkv ")]
    assert [(row[2], row[3]) for row in rows] == [("shrink", "engine"), ("expand", "engine")]
    for row in rows:
        registers, warps, programs = int(row[4]), int(row[7]), int(row[8])
        assert 0 < registers <= 255 and warps == 4
        assert 1 <= programs <= 16 and int(row[-1]) == programs * warps


def test_main_rejects_unknown_layers():
    with pytest.raises(SystemExit):
        kernel_resources.parse_args(["--layers", "qkv,lm_head"])


def test_main_refuses_the_interpreter(monkeypatch):
    """Under TRITON_INTERPRET=1 the kernels are not compiled: the tool says so instead of failing inside Triton."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET"):
        kernel_resources.main(["--layers", "qkv", "--tokens", "32"])
