"""The LoRA runtime's one owner: the model's LoRA layers and their slot storage, slot writes, the step
metadata, and the side stream with its scratch.

The model runner speaks to it through three calls: `for_step(token_slots)`
before an eager forward pass (writes the step's token -> slot metadata and
returns the pass's LoRA state, the ForwardContext's `lora`), `for_capture()`
when a CUDA graph is captured (the same static buffers), and
`write_metadata(token_slots)` before a graph replay (which reads the buffers
as it left them). Adapters are written into slots with `write_slot` (the
LoRA manager, which decides which adapter goes where, and the start-up graph
check with its probe adapters) and freed with `clear_slot`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_shrink import shrink_splits
from loraserve.lora.adapter import LoRAAdapter
from loraserve.lora.layers import GEMM_FIRST_LAYERS, LoRALinear
from loraserve.lora.metadata import LoRAMetaBuilder
from loraserve.lora.side_stream import SIDE_STREAM_MAX_TOKENS, LoRAScratch, LoRASideStream
from loraserve.models.lora_spec import LoRAModelSpec


@dataclass(frozen=True)
class LoRABatch:
    """The LoRA state of one forward pass (ForwardContext.lora), read by the LoRA layers only."""

    meta: LoRAMeta  # the step's token -> slot metadata (static device buffers)
    side: LoRASideStream | None  # decode-sized products beside the base GEMMs (CUDA); None: in place, in order


class LoRARuntime:
    """Wraps the model's LoRA targets in LoRALinear layers and owns everything they read at run time.

    `max_step_tokens`: the most tokens one forward pass holds (SchedulerConfig.max_step_tokens), which sizes
    the metadata. `model_name`: the served model's name, compared with an adapter's base model at load.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, max_step_tokens: int, model_name: str | None):
        self.config = config
        self.spec: LoRAModelSpec = replace(model.lora_spec(), model_name=model_name)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layers: list[tuple[int, LoRALinear]] = []  # (decoder layer index, LoRA layer), in model order
        for target in model.lora_targets():
            layer = LoRALinear(target.linear, target.slices, config.max_loras, config.max_lora_rank,
                               gemm_first=target.attr in GEMM_FIRST_LAYERS)
            setattr(target.parent, target.attr, layer)
            self.layers.append((target.layer_index, layer))
        self.metadata = LoRAMetaBuilder(max_step_tokens, config.max_loras, self.device)
        self.side: LoRASideStream | None = None
        self._load_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.side = LoRASideStream(torch.cuda.Stream(self.device),
                                       self._allocate_scratch(min(SIDE_STREAM_MAX_TOKENS, max_step_tokens)))
            self._load_stream = torch.cuda.Stream(self.device)

    def _allocate_scratch(self, max_tokens: int) -> LoRAScratch:
        """Static scratch for the side-stream products of every layer, steps of up to max_tokens tokens."""
        layers = [layer for _, layer in self.layers]
        splits = max(shrink_splits(t, layer.in_features, layer.lora_rows) for layer in layers for t in (1, max_tokens))
        return LoRAScratch.allocate(max_tokens, max(layer.out_features for layer in layers),
                                    max(layer.lora_rows for layer in layers), splits, self.dtype, self.device)

    # -- a forward pass -------------------------------------------------------------------
    def write_metadata(self, token_slots: np.ndarray) -> LoRAMeta:
        """Write the metadata of a step's tokens (token_slots: [T] slot per token, -1 = base) into the static
        buffers; the copy is issued on the current stream, ahead of the pass that reads it."""
        return self.metadata.build(token_slots)

    def for_step(self, token_slots: np.ndarray) -> LoRABatch:
        """write_metadata, and the LoRA state of an eager pass over these tokens."""
        return LoRABatch(self.write_metadata(token_slots), self._side_for_this_pass())

    def for_capture(self) -> LoRABatch:
        """The LoRA state of a pass captured into a CUDA graph: the static metadata buffers, not rewritten."""
        return LoRABatch(self.metadata.meta, self._side_for_this_pass())

    def _side_for_this_pass(self) -> LoRASideStream | None:
        return self.side.for_this_pass() if self.side is not None else None

    # -- slots --------------------------------------------------------------------------------
    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter into `slot` of every layer; on CUDA on a side stream, which the current stream
        then waits for, so the copy overlaps host work and earlier GPU work.

        The slot must be empty or hold an adapter no step in flight reads (steps sync on their sampled
        tokens before the next one is scheduled)."""
        if self._load_stream is None:
            self._write_layers(slot, adapter)
            return
        with torch.cuda.stream(self._load_stream):
            self._write_layers(slot, adapter)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        torch.cuda.current_stream(self.device).wait_event(done)

    def _write_layers(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer_index, layer in self.layers:
            layer.write_slot(slot, [adapter.weights.get((layer_index, m)) for m in layer.slice_names])

    def clear_slot(self, slot: int) -> None:
        """Free `slot`: rank 0 in every layer, so no kernel reads its weights."""
        for _, layer in self.layers:
            layer.clear_slot(slot)
