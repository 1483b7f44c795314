"""The tensor-parallel group of one process: its rank, the group's size and the collectives the layers use.

A `ParallelGroup` is passed explicitly to whatever needs it (the model's layers, the LoRA runtime, the model
runner); there is no global "current rank". `NO_PARALLEL` is the group of a process that holds the whole
model (size 1): every collective is then a no-op. A group of several processes talks through a torch.distributed
backend made for it alone (NCCL between GPUs, gloo between CPU processes), not through torch's default
process group, so one process may hold several engines. Rank 0 is the engine's own process; it hosts the
rendezvous store (`host_store`), the other ranks connect to it (`ParallelGroup.connect`).

Collectives are issued on the current CUDA stream's order (NCCL: on the backend's stream, fenced by events
with the current stream), so they can be captured in CUDA graphs. Between GPUs that reach each other peer to
peer, small sums skip NCCL: `PeerAllReduce` is one kernel on the caller's stream that reads every rank's
buffer (torch's symmetric memory); NCCL stays the plain fallback for everything else.
"""
from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory, _unregister_process_group

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # one host: every rank is a process of this machine
STORE_TIMEOUT = timedelta(minutes=5)  # ranks that do not reach the rendezvous by then fail to start
# A collective that waits longer than this fails (the backend's own watchdog). Start-up collectives wait for
# the slowest rank's weight load; a dead rank is noticed long before by the worker monitor.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
ABORT_SECONDS = 5.0  # the most a group's abort (or close) waits for its backend
PEER_ALL_REDUCE_BYTES = 2 << 20  # the largest all-reduce of a channel that takes the peer-to-peer path
MAIN, SIDE = 0, 1  # all-reduce channels: the forward's stream, the LoRA side stream (never sharing a buffer)


class GroupExchangeStore(dist.Store):
    """The store torch's symmetric memory exchanges buffer handles through, for one group. Torch numbers those
    exchanges with one counter per process ("<kind>/<n>/<rank>" keys): rank 0, which outlives its workers,
    would wait for keys that a later engine's fresh workers number from 0 (it hung). Here each rank numbers a
    kind's exchanges from this group's first one, so the keys of every rank agree; other keys pass as they
    are."""

    def __init__(self, store: dist.Store):
        super().__init__()
        self._store = store
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


class PeerAllReduce:
    """Small sums as one kernel on the caller's stream that reads every peer's buffer over NVLink (torch's
    symmetric memory, one-shot, no multicast), instead of NCCL's all-reduce: a decode step's all-reduces are
    latency-bound. One buffer per channel, so that all-reduces on two streams never share one; every rank
    calls the same ones in the same order, as for NCCL. The sum runs in the tensor's dtype, over the ranks in
    one order on every rank, so every rank gets the same bits."""

    def __init__(self, name: str, buffers: list[torch.Tensor]):
        self.name, self.buffers = name, buffers  # buffers[channel]: [PEER_ALL_REDUCE_BYTES] uint8, symmetric

    @staticmethod
    def possible(device: torch.device, size: int) -> bool:
        """Whether this rank can take part: CUDA, a group of 2, 4 or 8, torch with the one-shot op, and peer
        access to every other GPU of the group."""
        if device.type != "cuda" or size not in (2, 4, 8):
            return False
        if not (hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
                and hasattr(_SymmetricMemory, "set_group_info")):
            return False
        return all(torch.cuda.can_device_access_peer(device.index, d) for d in range(size) if d != device.index)

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
        buffers = []
        for _ in (MAIN, SIDE):
            buffer = symm_mem.empty(PEER_ALL_REDUCE_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, name)
            buffers.append(buffer)
        return cls(name, buffers)

    def close(self) -> None:
        """Leave torch's registry of process groups (the buffers go with this object)."""
        _unregister_process_group(self.name)

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


class ParallelGroup:
    """One process's place in a tensor-parallel group: `rank` of `size`, and the collectives between them.

    Tensors passed to the collectives live on `device` (CUDA for NCCL, CPU for gloo). Every rank must call
    the same collectives in the same order."""

    def __init__(self, rank: int, size: int, device: torch.device, backend=None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        if size > 1 and backend is None:
            raise ValueError("a group of several ranks needs a backend")
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self._backend = backend
        self._peer: PeerAllReduce | None = None  # small sums over NVLink, when every rank can

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device,
                custom_all_reduce: bool = True) -> "ParallelGroup":
        """Join the group of `size` ranks that meets at `store` (NCCL on CUDA devices, gloo on the CPU); returns
        when every rank has joined. With `custom_all_reduce`, small sums take the peer-to-peer path
        (PeerAllReduce) where every rank can."""
        device = torch.device(device)
        prefixed = dist.PrefixStore("loraserve-tp", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = COLLECTIVE_TIMEOUT
            backend = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
        group = cls(rank, size, device, backend)
        group.barrier()  # every rank is there (and NCCL's communicator is made now, not inside a graph capture)
        if custom_all_reduce and group.agree([int(PeerAllReduce.possible(device, size))], "min")[0]:
            try:
                peer = PeerAllReduce.connect(dist.PrefixStore("peer", prefixed), rank, size, device, backend)
            except RuntimeError as exc:  # every rank runs the same torch and driver: they fail alike
                logger.warning("all-reduces through NCCL only: the peer-to-peer buffers failed (%s)", exc)
                peer = None
            if group.agree([int(peer is not None)], "min")[0]:
                group._peer = peer
        return group

    # -- collectives (no-ops for a group of one) -------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum", channel: int = MAIN) -> torch.Tensor:
        """x (contiguous) <- the elementwise sum (or "min", "max") of x over the ranks, in place; returns x.
        `channel`: SIDE for all-reduces issued on the LoRA side stream (beside the forward's)."""
        if self.size > 1 and op == "sum" and self._peer is not None and self._peer.fits(x):
            self._peer(x, channel)
        elif self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
            self._backend.allreduce([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] on each rank -> [..., size * N]: the ranks' x side by side along the last dimension."""
        if self.size == 1:
            return x
        x = x.contiguous()
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # [size * rows, ..., N]: one collective
        self._backend._allgather_base(gathered, x).wait()
        parts = gathered.view(self.size, *x.shape)
        return parts.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x (contiguous) <- rank src's x, in place; returns x."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self._backend.broadcast([x], opts).wait()
        return x

    def barrier(self) -> None:
        if self.size > 1:
            self.all_reduce(torch.zeros(1, device=self.device))

    def agree(self, values: list[int], op: str) -> list[int]:
        """Host integers reduced over the ranks ("min" or "max"): how ranks agree on a size or a verdict."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self.all_reduce(t, op).tolist()]

    # -- the end ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Break off collectives in flight (a peer died): they fail instead of waiting for it forever. Returns
        within ABORT_SECONDS: NCCL's abort itself was seen to block for good (torch 2.11, NCCL 2.28, after
        the other ranks had left), so it runs on a thread of its own that is given up on after that."""
        if self._backend is None:
            return
        done = threading.Event()

        def abort(backend) -> None:
            try:
                backend.abort()
            except (RuntimeError, AttributeError):  # not every backend and release can abort
                pass
            done.set()

        threading.Thread(target=abort, args=(self._backend,), name="loraserve-tp-abort", daemon=True).start()
        if not done.wait(ABORT_SECONDS):
            logger.warning("the tensor-parallel group's backend did not finish aborting in %.0f s; left behind",
                           ABORT_SECONDS)

    def close(self) -> None:
        """Leave the group after its last collective, without waiting for the other ranks (collectives fail
        afterwards)."""
        self.abort()
        self._backend = None
        if self._peer is not None:
            self._peer.close()
            self._peer = None


NO_PARALLEL = ParallelGroup(0, 1, torch.device("cpu"))  # the whole model in one process: no collectives


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`store.port` tells the other ranks)."""
    return dist.TCPStore(STORE_HOST, 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    """A non-zero rank's connection to rank 0's store."""
    return dist.TCPStore(STORE_HOST, port, size, is_master=False, timeout=STORE_TIMEOUT)
