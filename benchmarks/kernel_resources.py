"""What the LoRA kernels ask of one SM, read from the compiler: no GPU needed.

For each packed Llama-3-8B layer (q/k/v, o, gate/up, down) and token count it makes the engine's launches of
the LoRA shrink and expand on CPU tensors (steps of up to 256 tokens: the delta expand of the side stream, as
decode steps run it; larger steps: the in-place expand), has Triton specialize those exact launches as its JIT
would and compile them for a Hopper GPU (sm_90, programmatic dependent launch on), and prints what ptxas
reports for each: registers per thread, spilled bytes (stack and local memory), shared memory (static and
dynamic), and how many of the kernel's programs fit on one SM by registers, by shared memory and by warps. The
least of the three bounds the warps an SM holds at once, and with it the bytes a latency-bound kernel (the
LoRA kernels of decode steps) has in flight. `--variants` adds the kernel shapes that lora_kernels.py times
beside the engine's: those of `--decode-grid --grid-variants` for steps of up to 256 tokens, those of
`--prefill-steps` for larger ones.

The numbers depend on the Triton version that compiles (the header names it) and on the pool's rank width
(`--rank-width`, default the engine's max_lora_rank): the shrink's row tiles and the pipelined expand's dot follow
it. It drives Triton's ahead-of-time path (the JIT's argument binder, `JITFunction._pack_args`, `compile`
with an explicit target) and the `cuobjdump` shipped with Triton's NVIDIA backend; written against Triton 3.6
and 3.9.

    python benchmarks/kernel_resources.py
    python benchmarks/kernel_resources.py --rank-width 16 --tokens 256 --layers qkv,gate_up --variants
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]
from lora_kernels import (  # noqa: E402 (one owner of the layers, their pools and the shapes timed)
    GRID_EXPAND_VARIANTS, GRID_SHRINK_VARIANTS, LAYERS, STEP_EXPAND_VARIANTS, STEP_SHRINK_VARIANTS, PoolLayer)

import loraserve.kernels.launch as launch  # noqa: E402
import loraserve.kernels.lora_shrink as lora_shrink_module  # noqa: E402
from loraserve.kernels.lora_expand import (  # noqa: E402
    EXPAND_SMALL_TILE_TOKENS, ExpandConfig, expand_config, lora_expand)
from loraserve.config import LoRAConfig  # noqa: E402
from loraserve.kernels.lora_meta import PAGE_RANK  # noqa: E402
from loraserve.kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config  # noqa: E402
from loraserve.lora.metadata import LoRAMetaBuilder  # noqa: E402

ARCH = 90  # sm_90 (H100, H200)
WARP = 32


class SMLimits(NamedTuple):
    """What one SM of compute capability ARCH holds (the CUDA programming guide's table)."""

    registers: int = 65536
    register_unit: int = 256  # registers are given to a warp in multiples of this
    partitions: int = 4  # the register file is split among this many schedulers; a warp's registers sit in one
    warps: int = 64
    programs: int = 32
    shared_bytes: int = 228 * 1024
    shared_reserved: int = 1024  # per program, taken by the system


class Resources(NamedTuple):
    """ptxas's report for one compiled kernel and the programs per SM it allows."""

    registers: int  # per thread
    spill_bytes: int  # stack + local memory per thread
    shared_bytes: int  # static + dynamic, per program
    num_warps: int

    def programs_by(self, limits: SMLimits = SMLimits()) -> dict[str, int]:
        """Programs per SM allowed by registers, shared memory and warps (and the hardware's program limit). A
        warp's registers come from one of the register file's partitions, so the warps an SM holds by registers
        are partitions x the warps one partition holds (as CUDA's occupancy calculator counts)."""
        per_warp = -(-self.registers * WARP // limits.register_unit) * limits.register_unit
        warps = limits.partitions * (limits.registers // limits.partitions // per_warp)
        return {"registers": warps // self.num_warps,
                "shared": limits.shared_bytes // (self.shared_bytes + limits.shared_reserved),
                "warps": min(limits.warps // self.num_warps, limits.programs)}

    def programs_per_sm(self, limits: SMLimits = SMLimits()) -> int:
        return min(self.programs_by(limits).values())


def captured_launches(run) -> list[tuple]:
    """(kernel, positional args, named args) of every Triton launch `run()` makes through the kernels'
    CachedLaunchers, none of them launched; PDL as on Hopper."""
    launches = []

    def capture(launcher, grid, args, named):
        launches.append((launcher.kernel, args, named))
        return args + tuple(named[n] for n in launcher.arg_names[len(args):]), None

    with mock.patch.object(launch.CachedLauncher, "_launch", capture), \
            mock.patch.object(launch, "pdl_supported", lambda t: True), \
            mock.patch.object(lora_shrink_module, "pdl_supported", lambda t: True):
        run()
    return launches


def compile_resources(kernel, args: tuple, named: dict, arch: int = ARCH) -> Resources:
    """Specialize and compile one captured launch for sm_`arch` as Triton's JIT would; ptxas's resource use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, WARP)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **named)
    options, signature, constexprs, attrs = kernel._pack_args(backend, named, bound, specialization, options)
    compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        report = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                check=True).stdout
    fields = dict(item.split(":", 1) for line in report.splitlines() if "REG:" in line
                  for item in line.split() if ":" in item)
    return Resources(int(fields["REG"]), int(fields["STACK"]) + int(fields["LOCAL"]),
                     int(fields["SHARED"]) + int(compiled.metadata.shared), int(compiled.metadata.num_warps))


class LayerLaunches:
    """One packed layer's pool views (pages scattered) for a pool of rank width R (max_lora_rank) and a step's
    metadata of T tokens over 8 rank-16 adapters, on the CPU: enough to make the engine's launches for it. The
    kernels' shapes follow T and R (not the adapters' number or ranks)."""

    def __init__(self, name: str, num_tokens: int, rank_width: int, adapters: int = 8, rank: int = 16):
        self.pool = PoolLayer(name, adapters, rank_width, [rank], torch.Generator().manual_seed(0), device="cpu")
        self.hidden, self.num_slices = self.pool.hidden, self.pool.num_slices
        self.meta = LoRAMetaBuilder(num_tokens, adapters, self.pool.table).build(torch.arange(num_tokens) % adapters)
        self.x = torch.randn(num_tokens, self.hidden, dtype=torch.bfloat16)  # [T, in]
        self.inter = torch.empty(num_tokens, self.num_slices * rank_width)  # [T, S*R] float32
        self.y = torch.empty(num_tokens, self.pool.n_out, dtype=torch.bfloat16)  # [T, N]
        self.decode = num_tokens <= EXPAND_SMALL_TILE_TOKENS  # the side stream's delta expand

    def shrink(self, config: ShrinkConfig | None = None) -> None:
        lora_shrink(self.x, self.pool.a, self.pool.rank, self.meta, self.num_slices, self.inter, config)

    def expand(self, config: ExpandConfig | None = None) -> None:
        lora_expand(self.inter, self.pool.b, self.pool.rank, self.meta, self.pool.offsets, self.y, config,
                    overwrite=self.decode, after_shrink=True)


def shapes(layer: LayerLaunches, num_tokens: int, variants: bool) -> list[tuple[str, str, object]]:
    """(kernel, shape name, the call that launches it) for the engine's shapes and, with `variants`, the shapes
    lora_kernels.py times beside them for T: the decode grid's (T <= 256), or those of --prefill-steps."""
    base = shrink_config(num_tokens, layer.hidden, layer.inter.shape[1])
    out = [("shrink", "engine", layer.shrink), ("expand", "engine", layer.expand)]
    if variants and layer.decode:
        out += [("shrink", name, lambda c=dataclasses.replace(base, **changes): layer.shrink(c))
                for name, changes in GRID_SHRINK_VARIANTS]
        out += [("expand", name, lambda c=config: layer.expand(c))
                for name, config, min_tokens in GRID_EXPAND_VARIANTS if num_tokens >= min_tokens]
    elif variants:
        out += [("shrink", name, lambda c=dataclasses.replace(base, **changes): layer.shrink(c))
                for name, changes in STEP_SHRINK_VARIANTS]
        out += [("expand", name, lambda c=dataclasses.replace(expand_config(num_tokens), **changes): layer.expand(c))
                for name, changes in STEP_EXPAND_VARIANTS]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    parser.add_argument("--tokens", default="32,256,8192", help="comma-separated token counts of a step")
    parser.add_argument("--rank-width", type=int, default=LoRAConfig.max_lora_rank,
                        help="the pool's rank width, max_lora_rank (default: the engine's)")
    parser.add_argument("--variants", action="store_true",
                        help="also the kernel shapes lora_kernels.py times beside the engine's")
    args = parser.parse_args(argv)
    args.layers = args.layers.split(",")
    unknown = [name for name in args.layers if name not in LAYERS]
    if unknown:
        parser.error(f"unknown layers {unknown}; choose from {', '.join(LAYERS)}")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be positive")
    if args.rank_width < 16 or args.rank_width % PAGE_RANK:
        parser.error(f"--rank-width must be at least 16 (the adapters' rank) and a multiple of {PAGE_RANK}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_resources.py compiles the kernels: run it without TRITON_INTERPRET=1")
    print(f"Triton {triton.__version__}, sm_{ARCH}: per SM {SMLimits().registers} registers, {SMLimits().warps} "
          f"warps, {SMLimits().shared_bytes // 1024} KiB shared memory; pool rank width {args.rank_width}")
    print(f"{'layer':8s} {'T':>5s} {'kernel':7s} {'shape':40s} {'regs':>5s} {'spill':>6s} {'smem KiB':>9s} "
          f"{'warps':>6s} {'programs/SM (regs, smem, warps)':>32s} {'warps/SM':>9s}")
    for name in args.layers:
        for num_tokens in args.tokens:
            layer = LayerLaunches(name, num_tokens, args.rank_width)
            for kernel_name, shape, run in shapes(layer, num_tokens, args.variants):
                (kernel, call_args, named), = captured_launches(run)
                res = compile_resources(kernel, call_args, named)
                by = res.programs_by()
                print(f"{name:8s} {num_tokens:5d} {kernel_name:7s} {shape:40s} {res.registers:5d} "
                      f"{res.spill_bytes:6d} {res.shared_bytes / 1024:9.1f} {res.num_warps:6d} "
                      f"{res.programs_per_sm():>17d} ({by['registers']}, {by['shared']}, {by['warps']}) "
                      f"{res.programs_per_sm() * res.num_warps:9d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
