"""Small sums of a tensor-parallel group as one kernel that reads every rank's buffer peer to peer.

A decode step's all-reduces are latency-bound: NCCL's takes ~17 us between two H200s where a one-shot kernel
over NVLink takes ~7 us. `PeerAllReduce` holds, on each rank, buffers that every other rank of the group can
read (torch's symmetric memory; its one-shot all-reduce, no NVLink multicast); `ParallelGroup` sends a sum
there when `PeerAllReduce.fits` it and everything else through NCCL. Torch's symmetric memory is a private
API: on a torch without it `possible` is False and every all-reduce goes through NCCL.

`GroupExchangeStore` is the store the buffers' handles are exchanged through (see its docstring for why the
group's own store does not do).
"""
from __future__ import annotations

import ctypes
import uuid

import torch
import torch.distributed as dist

try:  # torch's symmetric memory: private, and absent from older releases
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory, _unregister_process_group
except ImportError:
    symm_mem = None

PEER_ALL_REDUCE_BYTES = 2 << 20  # the largest all-reduce of a channel that takes the peer-to-peer path
MAIN, SIDE = 0, 1  # all-reduce channels: the forward's stream, the LoRA side stream (never sharing a buffer)


class GroupExchangeStore(dist.Store):
    """The store torch's symmetric memory exchanges buffer handles through, for one group. Torch numbers those
    exchanges with one counter per process ("<kind>/<n>/<rank>" keys): rank 0, which outlives its workers,
    would wait for keys that a later engine's fresh workers number from 0 (it hung). Here each rank numbers a
    kind's exchanges from this group's first one, so the keys of every rank agree; other keys pass as they
    are. Torch keeps the store for the process's life: `close` lets go of the store underneath."""

    def __init__(self, store: dist.Store):
        super().__init__()
        self._store: dist.Store | None = store
        self._first: dict[str, int] = {}  # exchange kind -> the process's counter at this group's first one

    def _key(self, key: str) -> str:
        kind, _, rest = key.partition("/")
        n, _, rank = rest.partition("/")
        if not (n.isdigit() and rank.isdigit()):
            return key
        first = self._first.setdefault(kind, int(n))
        return f"{kind}/{int(n) - first}/{rank}"

    def set(self, key, value):
        self._store.set(self._key(key), value)

    def get(self, key):
        return self._store.get(self._key(key))

    def wait(self, keys, timeout=None):
        keys = [self._key(k) for k in keys]
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def close(self) -> None:
        self._store = None


class PeerAllReduce:
    """Sums of up to PEER_ALL_REDUCE_BYTES (fp32 or bf16) as one kernel on the caller's stream: each rank
    copies its part into its buffer, the ranks meet at a barrier in the buffers' signal pads, and each reads
    and sums every rank's part in rank order, so every rank gets the same bits. One buffer per channel, so
    that all-reduces on two streams never share one; every rank calls the same ones in the same order, as for
    NCCL. The kernel waits for every peer without a time limit: a dead peer leaves it spinning (NCCL's abort
    does not reach it), which is why `abandon` exists."""

    def __init__(self, name: str, store: GroupExchangeStore, buffers: list[torch.Tensor]):
        self.name, self.store = name, store
        self.buffers = buffers  # buffers[channel]: [PEER_ALL_REDUCE_BYTES] uint8, symmetric

    @staticmethod
    def possible(device: torch.device, size: int) -> bool:
        """Whether this rank can take part: CUDA, a group of 2, 4 or 8, torch with the one-shot op, and peer
        access (NVLink or PCIe) to every other GPU of the group."""
        return (device.type == "cuda" and size in (2, 4, 8) and symm_mem is not None
                and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
                and hasattr(_SymmetricMemory, "set_group_info")
                and all(torch.cuda.can_device_access_peer(device.index, d) for d in range(size) if d != device.index))

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device,
                backend: dist.ProcessGroupNCCL) -> "PeerAllReduce":
        """Allocate and exchange the buffers: a collective of the ranks that meet at `store`. Symmetric memory
        finds its group by name in torch's registry of process groups: the group's NCCL backend is
        registered there under a name of this group alone (one process may hold several engines)."""
        if rank == 0:
            store.set("name", f"loraserve-tp-{uuid.uuid4().hex}")
        name = store.get("name").decode()
        exchange = GroupExchangeStore(dist.PrefixStore(name, store))
        _SymmetricMemory.set_group_info(name, rank, size, exchange)
        group = dist.ProcessGroup(exchange, rank, size)
        group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._set_group_name(name)
        _register_process_group(name, group)
        try:
            buffers = []
            for _ in (MAIN, SIDE):
                buffer = symm_mem.empty(PEER_ALL_REDUCE_BYTES, dtype=torch.uint8, device=device)
                symm_mem.rendezvous(buffer, name)
                buffers.append(buffer)
        except BaseException:
            _unregister_process_group(name)
            exchange.close()
            raise
        return cls(name, exchange, buffers)

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() and nbytes % 16 == 0
                and x.data_ptr() % 16 == 0 and nbytes <= PEER_ALL_REDUCE_BYTES)

    def __call__(self, x: torch.Tensor, channel: int) -> None:
        """x <- its sum over the ranks, in place (fits(x)): copied into this rank's buffer, summed from all."""
        staging = self.buffers[channel].view(x.dtype)[:x.numel()]  # [numel] of this rank's buffer
        flat = x.view(-1)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, flat, "sum", self.name, flat)

    def close(self) -> None:
        """After the group's last collective: leave torch's registry of process groups and let go of the
        exchange's store (the buffers go with this object)."""
        _unregister_process_group(self.name)
        self.store.close()

    def abandon(self) -> None:
        """A peer died: the buffers are never freed. Freeing one synchronizes the device, which may wait for
        good in a kernel that waits for the dead peer."""
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))  # one reference no one holds: never collected
