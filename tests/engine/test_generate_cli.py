"""`loraserve generate` in a subprocess: a prompt is required (or --demo), --stop repeats and takes one string
each time, bad files and values are clean usage errors (exit 2, no traceback)."""
import subprocess
import sys

import pytest


def _generate(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "loraserve.entrypoints.cli", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def test_stop_takes_one_string_each_time_and_the_prompt_stays_a_prompt(model):
    proc = _generate("--stop", ".", "--stop", "!", "Tell me a story", "--model", model, "--device", "cpu",
                     "--max-model-len", "64", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "### Tell me a story" in proc.stdout and proc.stdout.count("### ") == 1


@pytest.mark.parametrize("args, message", [
    ((), "no prompt"),
    (("--prompts-file", "/nonexistent/prompts.txt"), "No such file"),
    (("Hi", "--temperature", "3"), "--temperature must be in [0, 2]"),
])
def test_usage_errors_exit_2_without_a_traceback(model, tmp_path, args, message):
    proc = _generate(*args, "--model", model, "--device", "cpu")
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_empty_prompts_file_is_no_prompt(model, tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    proc = _generate("--prompts-file", str(empty), "--model", model, "--device", "cpu")
    assert proc.returncode == 2 and "no prompt" in proc.stderr
