"""CPU prefill: one long prompt through loraserve and through HF transformers on the same machine.

Loads the model once in each (the built-in default model unless --model gives an HF folder or a .gguf
file; HF reads the same GGUF, dequantized to float32), then times a prompt of --prompt-len random token ids
to its first generated token: `LLM.generate(max_tokens=1)` against one forward pass of HF's model over the
prompt (what HF's `generate` does first). Both in float32 with torch's threads as set (--threads). Prints
the seconds of each and loraserve/HF; writes cpu_prefill.json to --out.

    python benchmarks/cpu_prefill.py --prompt-len 4000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import LLM, SamplingParams  # noqa: E402
from loraserve.models.gguf_loader import default_model_path  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the built-in default model)")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--reps", type=int, default=1, help="timed runs of each (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def load_hf(model: str | None):
    from transformers import AutoModelForCausalLM

    path = model or default_model_path()
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def timed(fn, reps: int) -> float:
    fn_times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        fn_times.append(time.perf_counter() - t0)
    return statistics.median(fn_times)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    llm = LLM(args.model, device="cpu", dtype="float32", max_model_len=args.prompt_len + 8)
    vocab = llm.engine.hf_config.vocab_size
    prompt = rng.integers(0, vocab, args.prompt_len).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt[:32]}, params, use_tqdm=False)  # warm-up
    ours = timed(lambda: llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False), args.reps)
    del llm
    hf = load_hf(args.model)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf(ids[:, :32])  # warm-up
        theirs = timed(lambda: hf(ids, use_cache=True), args.reps)
    print(f"{args.prompt_len}-token prompt on the CPU ({torch.get_num_threads()} threads), float32: "
          f"loraserve {ours:.2f} s, HF transformers {theirs:.2f} s, loraserve / HF {ours / theirs:.2f}")
    bc.write_json(args.out, "cpu_prefill.json", {"benchmark": "cpu_prefill", "args": vars(args),
                                                  "env": bc.environment(torch.device("cpu")),
                                                  "loraserve_s": ours, "hf_s": theirs, "ratio": ours / theirs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
