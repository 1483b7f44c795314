"""LoRA products beside the base GEMMs: a side stream, its static scratch and launches bound once.

In decode-sized steps on CUDA each LoRA layer computes its product on the side
stream, forked from and joined back to the stream its forward pass is issued
on, into a delta (models.linear.LinearOutput) in the scratch, while the base
GEMM runs. Every layer shares one scratch: the products run in turn on the
side stream and each delta is read before the next product is forked. A layer
binds its two launches (shrink, expand) once per kernel shape
(BoundLoRADelta), so a later step, and a graph capture, costs two plain
launches per layer: no allocation, no argument binding.
"""
import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from loraserve.kernels.launch import BoundLaunch
from loraserve.kernels.lora_expand import ExpandConfig, expand_config, expand_grid, lora_expand
from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config, shrink_grid

# Steps of up to this many tokens compute the LoRA products beside the base GEMMs (on the side stream);
# larger (prefill) steps add them in place, in order: a [T, N] delta would cost too much memory there.
SIDE_STREAM_MAX_TOKENS = 512


@dataclass
class LoRAScratch:
    """Static buffers for LoRA products written to a separate delta (lora_delta), for up to max_tokens tokens.

    One scratch serves every LoRA layer of a model: the products run one after
    another on one stream, and each delta is consumed before the next product
    is launched. Views keep row strides that do not depend on T, so a bound
    launch (BoundLoRADelta) serves every token count.
    """

    max_tokens: int
    delta: torch.Tensor  # [Tmax * N max] model dtype
    inter: torch.Tensor  # [Tmax * S*R max] float32: the shrink's output
    partials: torch.Tensor  # [P max * Tmax * S*R max] float32: the shrink's split-K partial sums

    @classmethod
    def allocate(cls, max_tokens: int, max_out: int, max_sr: int, max_splits: int, dtype: torch.dtype,
                 device) -> "LoRAScratch":
        return cls(max_tokens, torch.empty(max_tokens * max_out, dtype=dtype, device=device),
                   torch.empty(max_tokens * max_sr, dtype=torch.float32, device=device),
                   torch.empty(max_splits * max_tokens * max_sr, dtype=torch.float32, device=device))

    def delta_view(self, num_tokens: int, n_out: int) -> torch.Tensor:  # [T, N]
        return self.delta[:num_tokens * n_out].view(num_tokens, n_out)

    def inter_view(self, num_tokens: int, sr: int) -> torch.Tensor:  # [T, S*R]
        return self.inter[:num_tokens * sr].view(num_tokens, sr)

    def partials_view(self, splits: int, num_tokens: int, sr: int) -> torch.Tensor:  # [P, T, S*R]
        return self.partials[:splits * self.max_tokens * sr].view(splits, self.max_tokens, sr)[:, :num_tokens]


class BoundLoRADelta:
    """lora_delta bound to one layer's weights, one LoRAMeta, one scratch and one kernel shape.

    `bound(x)` launches the shrink and the expand for x: [T, in] with only x
    checked (BoundLaunch) and returns the delta: the host cost of a LoRA layer in
    a decode step, and in a CUDA graph capture, is two launches. `fits` says
    whether it serves a call.
    """

    def __init__(self, shrink: BoundLaunch, expand: BoundLaunch, shrink_cfg: ShrinkConfig,
                 expand_cfg: ExpandConfig, meta: LoRAMeta, scratch: LoRAScratch, sr: int, n_out: int,
                 num_loras: int, reduce: Callable[[torch.Tensor], object] | None = None):
        self.shrink, self.expand = shrink, expand
        self.reduce = reduce  # runs on the shrink's output between the two launches (lora_delta)
        self.shrink_cfg, self.expand_cfg = shrink_cfg, expand_cfg
        self.meta, self.scratch = meta, scratch  # kept: the launches hold their buffers' addresses
        self.sr, self.n_out, self.num_loras = sr, n_out, num_loras
        # T -> (shrink grid, expand grid, delta view [T, N]): made once per token count, several us each
        self._steps: dict[int, tuple[tuple[int, int], tuple[int, int], torch.Tensor]] = {}

    def serves(self, meta: LoRAMeta, scratch: LoRAScratch) -> bool:
        """Bound to these buffers (a call with the token count it was made or found for)."""
        return meta is self.meta and scratch is self.scratch

    def fits(self, x: torch.Tensor, meta: LoRAMeta, scratch: LoRAScratch) -> bool:
        """Bound to these buffers and to the kernel shapes of x's token count."""
        t = x.shape[0]
        return (self.serves(meta, scratch) and 0 < t <= scratch.max_tokens
                and shrink_config(t, x.shape[1], self.sr) == self.shrink_cfg and expand_config(t) == self.expand_cfg)

    def __call__(self, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Launch on `stream` (default: the current stream); returns the delta: [T, N], a view of the scratch."""
        t = x.shape[0]
        step = self._steps.get(t)
        if step is None:
            step = self._steps[t] = (shrink_grid(self.shrink_cfg, t, self.sr, self.num_loras),
                                     expand_grid(self.expand_cfg, t, self.n_out, self.num_loras, True),
                                     self.scratch.delta_view(t, self.n_out))
        shrink_grid_t, expand_grid_t, delta = step
        self.shrink(shrink_grid_t, x, t, x.stride(0), x.stride(1), stream=stream)
        if self.reduce is not None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.reduce(self.scratch.inter_view(t, self.sr))
        self.expand(expand_grid_t, t, stream=stream)
        return delta


def lora_delta(x: torch.Tensor, scratch: LoRAScratch, lora_a: torch.Tensor, lora_b: torch.Tensor,
               lora_rank: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...],
               reduce: Callable[[torch.Tensor], object] | None = None) -> tuple[torch.Tensor, BoundLoRADelta]:
    """delta: [T, N] = LoRA(x: [T, in]) in scratch (zeros for tokens without an adapter), launched now
    on the current stream (CUDA), and a BoundLoRADelta that launches the same for another x.

    0 < T <= scratch.max_tokens. The delta is a view of the scratch: valid until the next call with it.
    `reduce`, when given, runs in place on the shrink's output [T, S*R] before the expand (tensor parallel:
    the all-reduce of a row-parallel layer's partial sums; the expand then waits for it in full).
    """
    num_tokens, hidden = x.shape
    num_loras = meta.num_loras  # the grids of lora_shrink and lora_expand: the bound launches take the same split
    sr = (len(slice_offsets) - 1) * meta.rank_width
    n_out = lora_b.shape[2]
    if not 0 < num_tokens <= scratch.max_tokens:
        raise ValueError(f"{num_tokens} tokens: the LoRA scratch holds 1..{scratch.max_tokens}")
    shrink_cfg, expand_cfg = shrink_config(num_tokens, hidden, sr), expand_config(num_tokens)
    delta, inter = scratch.delta_view(num_tokens, n_out), scratch.inter_view(num_tokens, sr)
    partials = scratch.partials_view(shrink_cfg.split_k, num_tokens, sr)
    shrink = lora_shrink(x, lora_a, lora_rank, meta, len(slice_offsets) - 1, inter, partials=partials, bind=True)
    if reduce is not None:
        reduce(inter)
    expand = lora_expand(inter, lora_b, lora_rank, meta, slice_offsets, delta, overwrite=True,
                         after_shrink=reduce is None, bind=True)
    return delta, BoundLoRADelta(shrink, expand, shrink_cfg, expand_cfg, meta, scratch, sr, n_out, num_loras,
                                 reduce)


@dataclass
class LoRASideStream:
    """Where decode-sized LoRA products run: on `stream`, forked from and joined back to `main` (the
    stream the forward pass is issued on), into `scratch`.

    `main` is None until `for_this_pass` gives a forward pass its own copy."""

    stream: torch.cuda.Stream
    scratch: LoRAScratch
    main: torch.cuda.Stream | None = None

    def for_this_pass(self) -> "LoRASideStream":
        """This side stream joined back to the current stream (the one a forward pass is about to be issued
        on). Called once per forward pass: looking the current stream up costs ~8 us, too much for every layer."""
        return replace(self, main=torch.cuda.current_stream(self.stream.device))
