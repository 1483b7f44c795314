"""The tensor-parallel group of one process: its rank, the group's size and the collectives the layers use.

A `ParallelGroup` is passed explicitly to whatever needs it (the model's layers, the LoRA runtime, the model
runner); there is no global "current rank". `NO_PARALLEL` is the group of a process that holds the whole
model (size 1): every collective is then a no-op. A group of several processes talks through a torch.distributed
backend made for it alone (NCCL between GPUs, gloo between CPU processes), not through torch's default
process group, so one process may hold several engines. Rank 0 is the engine's own process; it hosts the
rendezvous store (`host_store`), the other ranks connect to it (`ParallelGroup.connect`).

Collectives are issued on the current CUDA stream's order (NCCL: on the backend's stream, fenced by events
with the current stream), so they can be captured in CUDA graphs. Between GPUs that reach each other peer to
peer, small sums skip NCCL (loraserve.peer_all_reduce: one kernel on the caller's stream that reads every
rank's buffer); NCCL stays the plain path for everything else.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.peer_all_reduce import MAIN, PEER_ALL_REDUCE_BYTES, PeerAllReduce

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # one host: every rank is a process of this machine
STORE_TIMEOUT = timedelta(minutes=5)  # ranks that do not reach the rendezvous by then fail to start
# A collective that waits longer than this fails (the backend's own watchdog). Start-up collectives wait for
# the slowest rank's weight load; a dead rank is noticed long before by the worker monitor.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
ABORT_SECONDS = 5.0  # the most a group's abort (or close) waits for its backend


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
        self._peer: PeerAllReduce | None = None  # small sums peer to peer, when every rank can

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
            group._join_peer(dist.PrefixStore("peer", prefixed))
        return group

    def _join_peer(self, store: dist.Store) -> None:
        """Set up the peer-to-peer path with the other ranks (a collective); it is taken only if every rank's
        buffers were made, else every sum goes through NCCL."""
        try:  # a rank that fails alone leaves the others in the exchange until STORE_TIMEOUT
            peer = PeerAllReduce.connect(store, self.rank, self.size, self.device, self._backend)
        except RuntimeError as exc:
            logger.warning("all-reduces through NCCL only: the peer-to-peer buffers failed (%s)", exc)
            peer = None
        if not self.agree([int(peer is not None)], "min")[0]:
            if peer is not None:
                peer.close()
            return
        self._peer = peer
        if self.rank == 0:
            logger.info("tensor parallelism: sums of up to %d KiB (fp32, bf16) peer to peer, the rest through "
                        "NCCL", PEER_ALL_REDUCE_BYTES >> 10)

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
        """A peer died: break off NCCL's collectives in flight (they fail instead of waiting for it forever)
        and abandon the peer-to-peer buffers (PeerAllReduce.abandon: their kernels can't be broken off, and
        freeing the buffers would wait for them). Returns within ABORT_SECONDS."""
        if self._peer is not None:
            self._peer.abandon()
            self._peer = None
        self._abort_backend()

    def _abort_backend(self) -> None:
        """NCCL's abort (gloo's), on a thread of its own that is given up on after ABORT_SECONDS: it was seen
        to block for good (torch 2.11, NCCL 2.28, after the other ranks had left)."""
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
        self._abort_backend()
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
