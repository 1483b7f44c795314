"""The peer-to-peer all-reduce of small sums (peer_all_reduce.PeerAllReduce) on 2 and 4 GPUs: the same bits as the
sum over the ranks in rank order, in place, in and out of CUDA graphs, with the two channels running at once
on two streams; larger sums and other ops through NCCL; a second group of one long-lived rank 0 (marked gpu
and multigpu)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from loraserve.distributed import ParallelGroup, host_store, join_store
from loraserve.peer_all_reduce import MAIN, PEER_ALL_REDUCE_BYTES, SIDE

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

SHAPES = [(1, 4096), (32, 8192), (7, 1000), (PEER_ALL_REDUCE_BYTES // 4 // 8192, 8192)]


def _inputs(rank: int, shape, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(1000 * rank + shape[0])
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _in_rank_order(size: int, shape, dtype, device) -> torch.Tensor:
    total = _inputs(0, shape, dtype, device)
    for rank in range(1, size):
        total = total + _inputs(rank, shape, dtype, device)
    return total


class _Counted:
    """The group's PeerAllReduce, counting the sums it takes (the rest went through NCCL)."""

    def __init__(self, peer):
        self.peer, self.calls = peer, 0

    def fits(self, x):
        return self.peer.fits(x)

    def __call__(self, x, channel):
        self.calls += 1
        self.peer(x, channel)


def _rank(rank: int, size: int, port: int, failures) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = ParallelGroup.connect(join_store(port, size), rank, size, device)
    try:
        assert group._peer is not None, "peer-to-peer all-reduce not set up"
        group._peer = counted = _Counted(group._peer)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                x = _inputs(rank, shape, dtype, device)
                group.all_reduce(x)
                torch.testing.assert_close(x, _in_rank_order(size, shape, dtype, device), rtol=0, atol=0)
        # both channels at once, captured in one graph: the forward's stream and a side stream
        a, b = _inputs(rank, (32, 8192), torch.float32, device), _inputs(rank, (32, 16), torch.float32, device)
        a0, b0 = a.clone(), b.clone()
        side = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                group.all_reduce(b, channel=SIDE)
            group.all_reduce(a, channel=MAIN)
            torch.cuda.current_stream().wait_stream(side)
        for _ in range(3):
            a.copy_(a0), b.copy_(b0)
            graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(a, _in_rank_order(size, (32, 8192), torch.float32, device), rtol=0, atol=0)
        torch.testing.assert_close(b, _in_rank_order(size, (32, 16), torch.float32, device), rtol=0, atol=0)
        assert counted.calls == 2 * len(SHAPES) + 2  # every sum so far took the peer path (two in the capture)
        big = torch.full((PEER_ALL_REDUCE_BYTES // 4 + 4,), float(rank + 1), device=device)  # through NCCL
        group.all_reduce(big)
        top = group.all_reduce(torch.tensor([rank], device=device), "max")
        assert big.eq(size * (size + 1) / 2).all() and top.item() == size - 1
        assert counted.calls == 2 * len(SHAPES) + 2  # neither the larger sum nor the max
        torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)  # as the engine's workers end: without leaving the group (its abort waits for the graph)


@pytest.mark.parametrize("size", [2, 4])
def test_small_sums_over_nvlink_equal_the_sum_in_rank_order(size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} CUDA devices")
    store = host_store(size + 1)  # this process keeps the store; the ranks join it
    context = mp.get_context("spawn")
    failures = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, size, store.port, failures)) for rank in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(180)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors, errors
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]


def _fresh_rank(port: int, failures) -> None:
    """Rank 1 of one group, a process of its own (as an engine's worker): one peer-to-peer sum."""
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    group = ParallelGroup.connect(join_store(port, 2), 1, 2, device)
    try:
        assert group._peer is not None, "peer-to-peer all-reduce not set up"
        x = torch.full((4, 256), 2.0, device=device)
        group.all_reduce(x)
        assert x.eq(3.0).all()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failures.put(f"rank 1 (port {port}): {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def _long_lived_rank0(ports, failures) -> None:
    """Rank 0 of one group after another in one process, as the engine's process of a second engine."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    try:
        for port in ports:
            group = ParallelGroup.connect(join_store(port, 2), 0, 2, device)
            assert group._peer is not None, "peer-to-peer all-reduce not set up"
            x = torch.full((4, 256), 1.0, device=device)
            group.all_reduce(x)
            assert x.eq(3.0).all()
            group.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failures.put(f"rank 0: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def test_a_second_group_of_a_long_lived_rank_0_sets_up_its_buffers():
    """Rank 0 outlives its first group's workers and joins a second group with fresh ones: the buffers'
    exchange must not wait for keys the fresh ranks never write (torch numbers exchanges per process)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    stores = [host_store(3), host_store(3)]  # kept by this process; each group's ranks join one
    context = mp.get_context("spawn")
    failures = context.Queue()
    rank0 = context.Process(target=_long_lived_rank0, args=([s.port for s in stores], failures))
    rank0.start()
    for store in stores:  # the second group's rank 1 starts once the first's has ended
        fresh = context.Process(target=_fresh_rank, args=(store.port, failures))
        fresh.start()
        fresh.join(120)
        if fresh.is_alive():
            fresh.kill()
        assert fresh.exitcode == 0, (fresh.exitcode, failures.get() if not failures.empty() else "timed out")
    rank0.join(60)
    if rank0.is_alive():
        rank0.kill()
    assert rank0.exitcode == 0, (rank0.exitcode, failures.get() if not failures.empty() else "timed out")
