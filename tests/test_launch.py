"""CachedLauncher: one Triton dispatch per specialization, a new one whenever Triton would specialize differently.

A stand-in kernel records the calls that reach Triton's path (`kernel[grid](...)`) and those
launched from the cache (`compiled[grid](...)`), so the key logic is checked without a GPU.
"""
import types

import pytest
import torch

from loraserve.kernels import launch
from loraserve.kernels.launch import CachedLauncher, cdiv, next_power_of_2


class FakeCompiled(launch.CompiledKernel):
    def __init__(self, log):  # no CompiledKernel state: nothing is loaded
        self.module = None
        self.log = log
        self.metadata_log = []  # (launch metadata, enter hook, exit hook) given to each direct launch

    function = packed_metadata = None

    def __getitem__(self, grid):
        def run(*params, stream=None):
            self.log.append(("cached", grid, params, stream))
        return run

    @property
    def run(self):  # the launcher under __getitem__, which BoundLaunch calls directly
        def run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter, exit, *params):
            self.log.append(("cached", (grid_x, grid_y, grid_z), params, stream))
            self.metadata_log.append((launch_metadata, enter, exit))
        return run

    def launch_metadata(self, grid, stream, *params):
        return ("metadata", grid, stream, params)

    def __del__(self):
        pass


class FakeKernel:
    """Looks like a @triton.jit function with do_not_specialize=["n"]."""

    do_not_specialize = ["n"]

    def __init__(self):
        self.log = []

        def fn(x_ptr, y_ptr, n, stride, BLOCK):
            pass
        self.fn = fn

    def __getitem__(self, grid):
        def run(*args, **named):
            self.log.append(("triton", grid, args, named))
            return FakeCompiled(self.log)
        return run


@pytest.fixture
def kernel(monkeypatch):
    fake_driver = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=fake_driver))
    return FakeKernel()


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_second_call_launches_the_cached_kernel_with_every_parameter(kernel):
    launcher = CachedLauncher(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((4,), x, y, 100, 64, BLOCK=128, num_warps=4)
    launcher((4, 2), x, y, 100, 64, BLOCK=128, num_warps=4)
    assert kinds(kernel) == ["triton", "cached"]
    _, grid, params, stream = kernel.log[1]
    assert grid == (4, 2, 1) and stream == 1234
    assert params[:2] == (x, y) and params[2:] == (100, 64, 128)  # the constexpr comes last, by name


def test_do_not_specialize_argument_changes_only_by_width(kernel):
    launcher = CachedLauncher(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (1, 16, 17, 1000):  # Triton would keep one kernel for all of these
        launcher((1,), x, y, n, 64, BLOCK=128)
    launcher((1,), x, y, 2**40, 64, BLOCK=128)  # a 64-bit value is another kernel
    assert kinds(kernel) == ["triton", "cached", "cached", "cached", "triton"]


@pytest.mark.parametrize("change", ["stride", "alignment", "dtype", "constexpr", "option"])
def test_a_different_specialization_goes_through_triton(kernel, change):
    launcher = CachedLauncher(kernel)
    buf = torch.zeros(64)
    base = dict(x=buf, y=buf, stride=64, BLOCK=128, num_warps=4)
    launcher((1,), base["x"], base["y"], 10, base["stride"], BLOCK=base["BLOCK"], num_warps=base["num_warps"])
    other = dict(base)
    if change == "stride":
        other["stride"] = 65  # not a multiple of 16 any more
    elif change == "alignment":
        other["y"] = buf[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        other["x"] = buf.to(torch.float16)
    elif change == "constexpr":
        other["BLOCK"] = 256
    else:
        other["num_warps"] = 8
    launcher((1,), other["x"], other["y"], 10, other["stride"], BLOCK=other["BLOCK"],
             num_warps=other["num_warps"])
    assert kinds(kernel) == ["triton", "triton"]


def test_interpreted_kernels_are_never_cached(kernel):
    kernel.__class__ = type("Interpreted", (FakeKernel,), {
        "__getitem__": lambda self, grid: (lambda *a, **k: self.log.append(("triton",)))})
    launcher = CachedLauncher(kernel)
    x = torch.zeros(4)
    launcher((1,), x, x, 1, 1, BLOCK=1)
    launcher((1,), x, x, 1, 1, BLOCK=1)
    assert kinds(kernel) == ["triton", "triton"]


def test_bound_launch_replaces_only_its_variable_arguments(kernel):
    launcher = CachedLauncher(kernel)
    x, y, x2 = torch.zeros(64), torch.zeros(64), torch.zeros(32)
    bound = launcher.call_and_bind((4,), x, y, 100, 64, BLOCK=128, num_warps=4, variable=("x_ptr", "n"))
    bound((2,), x2, 7)
    assert kinds(kernel) == ["triton", "cached"]
    _, grid, params, stream = kernel.log[1]
    assert grid == (2, 1, 1) and stream == 1234
    # tensors go to Triton's launcher as their device addresses
    assert params[0] == x2.data_ptr() and params[1] == y.data_ptr() and params[2:] == (7, 64, 128)
    assert bound._params[0] is None  # the variable tensor is not kept after the call


def test_bound_launch_on_a_given_stream(kernel):
    """stream= sends the launch to that stream's handle instead of the current stream's."""
    launcher = CachedLauncher(kernel)
    x = torch.zeros(64)
    bound = launcher.call_and_bind((4,), x, x, 100, 64, BLOCK=128, variable=("n",))
    bound((2,), 7, stream=types.SimpleNamespace(cuda_stream=777))
    bound((2,), 8)
    assert [(entry[0], entry[3]) for entry in kernel.log[1:]] == [("cached", 777), ("cached", 1234)]


def test_bound_launch_builds_launch_metadata_only_while_a_hook_is_set(kernel, monkeypatch):
    """A profiler's launch hook gets the metadata Triton would build, from the tensors; without a hook
    (None, or an empty hook chain) neither hooks nor metadata go to the launcher."""
    launcher = CachedLauncher(kernel)
    x, y, x2 = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    bound = launcher.call_and_bind((4,), x, y, 100, 64, BLOCK=128, variable=("x_ptr", "n"))
    compiled = bound._compiled
    hooks = {"none": None, "empty chain": types.SimpleNamespace(calls=[]), "chain": types.SimpleNamespace(calls=[print]),
             "function": print}
    for name, hook in hooks.items():
        monkeypatch.setattr(launch, "knobs", types.SimpleNamespace(
            runtime=types.SimpleNamespace(launch_enter_hook=hook, launch_exit_hook=None)))
        bound((2,), x2, 7)
        metadata, enter, leave = compiled.metadata_log[-1]
        if name in ("none", "empty chain"):
            assert metadata is None and enter is None and leave is None, name
        else:
            assert enter is hook
            assert metadata[:3] == ("metadata", (2,), 1234) and metadata[3][0] is x2 and metadata[3][1:] == (y, 7, 64, 128)


def test_bound_launch_goes_through_triton_when_a_variable_argument_specializes_otherwise(kernel):
    launcher = CachedLauncher(kernel)
    buf = torch.zeros(64)
    bound = launcher.call_and_bind((1,), buf, buf, 10, 64, BLOCK=128, variable=("x_ptr", "n"))
    bound((1,), buf[1:], 10)  # misaligned
    bound((1,), buf, 2**40)  # a 64-bit integer
    bound((1,), buf, 11)
    assert kinds(kernel) == ["triton", "triton", "triton", "cached"]
    args = kernel.log[1][2]  # every parameter, the constexpr included, in order
    assert args[0].data_ptr() == buf[1:].data_ptr() and args[1:] == (buf, 10, 64, 128)


def test_bound_launch_of_an_interpreted_kernel_always_goes_through_triton(kernel):
    kernel.__class__ = type("Interpreted", (FakeKernel,), {
        "__getitem__": lambda self, grid: (lambda *a, **k: self.log.append(("triton", grid, a, k)))})
    launcher = CachedLauncher(kernel)
    x = torch.zeros(4)
    bound = launcher.call_and_bind((1,), x, x, 1, 1, BLOCK=1, variable=("n",))
    bound((3,), 5)
    assert kinds(kernel) == ["triton", "triton"]
    assert kernel.log[1][1] == (3,) and kernel.log[1][2][2] == 5


@pytest.mark.parametrize("a,b", [(0, 4), (1, 4), (4, 4), (5, 4), (4097, 128)])
def test_cdiv(a, b):
    assert cdiv(a, b) == (a + b - 1) // b


@pytest.mark.parametrize("n,want", [(0, 1), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (4096, 4096)])
def test_next_power_of_2(n, want):
    assert next_power_of_2(n) == want
