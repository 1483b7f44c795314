"""Plain-torch LoRA shrink/expand over the static slot storage.

The oracle for the Triton kernels and the engine's CPU path. It loops over the
slots present on the host (a host sync: never use it inside a CUDA graph) and
computes in float32, counting only the first slot_rank[slot] ranks.

Storage (loraserve.lora.layers.LoRALinear), for a packed layer of S slices:
  lora_a: [L, S*R, in]   rows s*R .. s*R+R-1 are slice s's A
  lora_b: [L, N, R]      rows slice_offsets[s] .. slice_offsets[s+1]-1 are slice s's B
  slot_rank: [L] int32   rank of the adapter in each slot, 0 = empty
"""
import torch


def _slot_rows(token_slots: torch.Tensor, num_tokens: int, slot_rank: torch.Tensor):
    """Yield (slot, rank, row indices) for every slot with tokens and rank > 0."""
    slots = token_slots[:num_tokens].to("cpu", torch.int64)  # slots: [T]
    ranks = slot_rank.to("cpu", torch.int64)
    for slot in torch.unique(slots).tolist():
        if slot < 0 or ranks[slot] == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1).to(token_slots.device)
        yield slot, int(ranks[slot]), rows


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, slot_rank: torch.Tensor,
                    token_slots: torch.Tensor, num_slices: int) -> torch.Tensor:
    """Return inter: [T, S*R] float32 with inter[t, s*R + r] = x[t] . A[slot_t, s*R + r].

    Columns r >= slot_rank[slot_t] and rows of tokens without a slot are zero.
    """
    num_tokens = x.shape[0]
    num_loras, sr, hidden = lora_a.shape
    if sr % num_slices:
        raise ValueError(f"lora_a has {sr} rows, not a multiple of {num_slices} slices")
    rank_max = sr // num_slices
    out = torch.zeros(num_tokens, num_slices, rank_max, dtype=torch.float32, device=x.device)
    for slot, rank, rows in _slot_rows(token_slots, num_tokens, slot_rank):
        a = lora_a[slot].view(num_slices, rank_max, hidden)[:, :rank].float()  # a: [S, r, in]
        xs = x[rows].float()  # xs: [n, in]
        out[rows, :, :rank] = torch.einsum("ti,sri->tsr", xs, a)
    return out.view(num_tokens, sr)


def lora_expand_ref(inter: torch.Tensor, lora_b: torch.Tensor, slot_rank: torch.Tensor,
                    token_slots: torch.Tensor, slice_offsets, y: torch.Tensor) -> None:
    """In place: y[t, n] += round(inter[t, s*R + :r] . B[slot_t, n, :r]) for n in slice s (rounded to y's dtype).

    Rows of tokens without a slot are left untouched.
    """
    num_tokens, n_out = y.shape
    num_slices = len(slice_offsets) - 1
    rank_max = lora_b.shape[2]
    if slice_offsets[0] != 0 or slice_offsets[-1] != n_out:
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} must span 0..{n_out}")
    for slot, rank, rows in _slot_rows(token_slots, num_tokens, slot_rank):
        delta = torch.empty(len(rows), n_out, dtype=torch.float32, device=y.device)
        for s in range(num_slices):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            a = inter[rows, s * rank_max:s * rank_max + rank].float()  # a: [n, r]
            b = lora_b[slot, lo:hi, :rank].float()  # b: [hi-lo, r]
            delta[:, lo:hi] = a @ b.T
        y[rows] = (y[rows].float() + delta.to(y.dtype).float()).to(y.dtype)  # the product rounds first
