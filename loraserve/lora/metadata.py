"""Per-step LoRA metadata on the host: which slot each token uses, and the tokens grouped by slot.

The grouping (kernels/lora_meta.LoRAMeta) is computed with numpy, written into
a pinned staging buffer and sent to static device buffers with one
non-blocking copy, so a step needs no GPU sort and no host sync, and CUDA
graphs captured once keep reading the same device addresses. The builder also
owns the split-K shrink's tile counters.
"""
import numpy as np
import torch

from loraserve.kernels.lora_meta import COUNTER_BLOCK_M, COUNTER_ROW_TILES, LoRAMeta


class LoRAMetaBuilder:
    """Owns the static metadata buffers and refills them each step.

    The device buffer is one int32 vector whose views are the LoRAMeta fields,
    so a step costs one host->device copy. Two pinned staging buffers are used
    in turn; before one is overwritten, the event recorded after its previous
    copy is awaited, so a copy still in flight is never corrupted. The copy is
    issued on the current stream, ahead of the kernels that read the metadata.
    The tile counters are zeroed once here and never copied over.
    """

    def __init__(self, max_tokens: int, max_loras: int, device):
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(
                f"max_tokens and max_loras must be >= 1, got {max_tokens}, {max_loras}")
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self.device = torch.device(device)
        size = 2 * max_tokens + 2 * max_loras
        is_cuda = self.device.type == "cuda"
        # buf: [2*Tmax + 2*L] int32 = token_slots | sorted_token_ids | slot_start | slot_count
        self._device_buf = torch.full((size,), -1, dtype=torch.int32, device=self.device)
        self._staging = [torch.empty(size, dtype=torch.int32, pin_memory=is_cuda)
                         for _ in range(2 if is_cuda else 1)]
        self._copy_done = [torch.cuda.Event() if is_cuda else None for _ in self._staging]
        self._next = 0
        # counters: [cdiv(Tmax, 16) + min(L, Tmax), COUNTER_ROW_TILES], one per shrink output tile
        tiles = -(-max_tokens // COUNTER_BLOCK_M) + min(max_loras, max_tokens)
        counters = torch.zeros(tiles, COUNTER_ROW_TILES, dtype=torch.int32, device=self.device)
        self.meta = LoRAMeta(*self._split(self._device_buf), counters)

    def _split(self, buf):
        t, n = self.max_tokens, self.max_loras
        return buf[:t], buf[t:2 * t], buf[2 * t:2 * t + n], buf[2 * t + n:]

    def build(self, token_slots: np.ndarray) -> LoRAMeta:
        """Write the metadata of one step; token_slots: [T] ints in [-1, max_loras)."""
        slots = np.asarray(token_slots)
        if slots.ndim != 1:
            raise ValueError(f"token_slots must be 1-D, got shape {slots.shape}")
        if slots.size and not np.issubdtype(slots.dtype, np.integer):
            raise ValueError(f"token_slots must hold integers, got {slots.dtype}")
        t = slots.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed max_tokens={self.max_tokens}")
        if t and (slots.min() < -1 or slots.max() >= self.max_loras):
            raise ValueError(
                f"token slots must lie in [-1, {self.max_loras}), "
                f"got [{slots.min()}, {slots.max()}]")
        slots = slots.astype(np.int64, copy=False)

        index = self._next
        self._next = (index + 1) % len(self._staging)
        if self._copy_done[index] is not None:
            self._copy_done[index].synchronize()
        staging = self._staging[index]
        ts, sorted_ids, start, count = (v.numpy() for v in self._split(staging))

        # keys: [T], base tokens sort after every slot
        keys = np.where(slots < 0, self.max_loras, slots)
        ts[:t] = slots
        ts[t:] = -1
        sorted_ids[:t] = np.argsort(keys, kind="stable")
        sorted_ids[t:] = -1
        count[:] = np.bincount(keys, minlength=self.max_loras + 1)[:self.max_loras]
        start[:] = np.cumsum(count) - count

        self._device_buf.copy_(staging, non_blocking=True)
        if self._copy_done[index] is not None:
            self._copy_done[index].record()
        return self.meta
