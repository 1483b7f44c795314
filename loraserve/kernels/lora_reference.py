"""Plain-torch LoRA shrink/expand over the paged adapter pool, and the extra GEMM columns that
lora_columns.py places (`place_factors_ref`, `place_b_ref`).

The oracle for the Triton kernels and the engine's CPU path. It loops over the
adapters present on the host (a host sync: never use it inside a CUDA graph),
gathers each one's rank rows from its pages and computes in float32, counting
only the first lora_rank[adapter] ranks.

Storage (kernels/lora_meta.py), for a packed layer of S slices and pages of PAGE_RANK rank rows:
  lora_a: [P, S*PAGE_RANK, in]   page rows s*PAGE_RANK + j: rank row j (of that page) of slice s's A
  lora_b: [P, PAGE_RANK, N]      page row j: rank row j of B^T; columns slice_offsets[s]: of slice s
  lora_rank: [A] int32           the rank of each adapter id in this layer, 0 = none
  meta.page_table: [A, max_pages] the page of each adapter id's rank rows r // PAGE_RANK
The intermediate is [T, S*R] with R = meta.rank_width = max_pages * PAGE_RANK.
"""
import torch

from loraserve.kernels.lora_meta import PAGE_RANK, LoRAMeta


def _adapter_rows(meta: LoRAMeta, num_tokens: int, lora_rank: torch.Tensor):
    """Yield (adapter id, rank, pages, row indices) for every adapter with tokens and rank > 0."""
    slots = meta.token_slots[:num_tokens].to("cpu", torch.int64)  # slots: [T]
    adapters = meta.slot_adapter.to("cpu", torch.int64)
    ranks = lora_rank.to("cpu", torch.int64)
    table = meta.page_table.to("cpu", torch.int64)
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        adapter = int(adapters[slot])
        rank = int(ranks[adapter]) if adapter >= 0 else 0
        if rank == 0:
            continue
        pages = table[adapter, :-(-rank // PAGE_RANK)].to(meta.token_slots.device)
        rows = (slots == slot).nonzero().squeeze(1).to(meta.token_slots.device)
        yield adapter, rank, pages, rows


def gather_a(lora_a: torch.Tensor, pages: torch.Tensor, num_slices: int, rank: int) -> torch.Tensor:
    """One adapter's A from its pages: [S, rank, in]."""
    a = lora_a[pages].view(len(pages), num_slices, PAGE_RANK, -1)  # a: [pages, S, PAGE_RANK, in]
    return a.transpose(0, 1).reshape(num_slices, len(pages) * PAGE_RANK, -1)[:, :rank]


def gather_b(lora_b: torch.Tensor, pages: torch.Tensor, rank: int) -> torch.Tensor:
    """One adapter's B^T from its pages: [rank, N]."""
    return lora_b[pages].reshape(len(pages) * PAGE_RANK, -1)[:rank]


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, lora_rank: torch.Tensor, meta: LoRAMeta,
                    num_slices: int) -> torch.Tensor:
    """Return inter: [T, S*R] float32 with inter[t, s*R + r] = x[t] . A_s[adapter_t, r].

    Columns r >= the adapter's rank and rows of tokens without a slot are zero.
    """
    num_tokens = x.shape[0]
    if lora_a.shape[1] != num_slices * PAGE_RANK:
        raise ValueError(f"lora_a's pages hold {lora_a.shape[1]} rows, not {num_slices} slices of {PAGE_RANK}")
    r_max = meta.rank_width
    out = torch.zeros(num_tokens, num_slices, r_max, dtype=torch.float32, device=x.device)
    for _, rank, pages, rows in _adapter_rows(meta, num_tokens, lora_rank):
        a = gather_a(lora_a, pages, num_slices, rank).float()  # a: [S, r, in]
        out[rows, :, :rank] = torch.einsum("ti,sri->tsr", x[rows].float(), a)
    return out.view(num_tokens, num_slices * r_max)


def lora_expand_ref(inter: torch.Tensor, lora_b: torch.Tensor, lora_rank: torch.Tensor, meta: LoRAMeta,
                    slice_offsets, y: torch.Tensor) -> None:
    """In place: y[t, n] += round(inter[t, s*R + :r] . B_s[adapter_t, n, :r]) for n in slice s (rounded to
    y's dtype). Rows of tokens without a slot are left untouched.
    """
    num_tokens, n_out = y.shape
    num_slices = len(slice_offsets) - 1
    r_max = meta.rank_width
    if slice_offsets[0] != 0 or slice_offsets[-1] != n_out:
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} must span 0..{n_out}")
    for _, rank, pages, rows in _adapter_rows(meta, num_tokens, lora_rank):
        b = gather_b(lora_b, pages, rank).float()  # b: [r, N]
        delta = torch.empty(len(rows), n_out, dtype=torch.float32, device=y.device)
        for s in range(num_slices):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta[:, lo:hi] = inter[rows, s * r_max:s * r_max + rank].float() @ b[:, lo:hi]
        y[rows] = (y[rows].float() + delta.to(y.dtype).float()).to(y.dtype)  # the product rounds first


def place_factors_ref(inter: torch.Tensor, token_slots: torch.Tensor, slot_adapter: torch.Tensor,
                      slot_columns: torch.Tensor, lora_rank: torch.Tensor, rank_width: int, num_slices: int,
                      step_columns: int, extra: int) -> torch.Tensor:
    """The extra columns place_factors writes, [T, extra] float32, from plain indexing (tests)."""
    out = torch.zeros(inter.shape[0], extra, dtype=torch.float32)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        first, rank = int(slot_columns[slot]), int(lora_rank[int(slot_adapter[slot])])
        for s in range(num_slices):
            c = s * step_columns + first
            out[t, c:c + rank] = inter[t, s * rank_width:s * rank_width + rank].float()
    return out


def place_b_ref(b_t: list[torch.Tensor | None], slot_columns: list[int], slice_offsets: list[int], n_out: int,
                step_columns: int, extra: int) -> torch.Tensor:
    """The extra columns place_b writes, [N, extra] float32: b_t[l] is slot l's adapter's B^T [r_l, N] at its
    rank in this layer (None: rank 0) (tests)."""
    out = torch.zeros(n_out, extra, dtype=torch.float32)
    for slot, b in enumerate(b_t):
        if b is None:
            continue
        for s in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            c = s * step_columns + slot_columns[slot]
            out[lo:hi, c:c + b.shape[0]] = b[:, lo:hi].t().float()
    return out
