"""CachedLauncher: one Triton dispatch per specialization, a new one whenever Triton would specialize differently.

A stand-in kernel records the calls that reach Triton's path (`kernel[grid](...)`) and those
launched from the cache (`compiled[grid](...)`), so the key logic is checked without a GPU; so is the
fallback to `kernel[grid]` on an untested Triton or when a direct launch raises.
"""
import contextlib
import importlib.util
import inspect
import sys
import types

import pytest
import torch
import triton

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


TESTED = "%d.%d.0" % max(launch.TESTED_TRITON_VERSIONS)  # a Triton version the direct launch is used with


@pytest.fixture
def kernel(monkeypatch):
    fake_driver = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=fake_driver))
    monkeypatch.setattr(launch, "_fast_path", launch._FastPath(TESTED))  # a fresh switch, not yet decided
    return FakeKernel()


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def calls(kernel):
    """The calls through kernel[grid], each as (grid, every parameter by name, the launch options): the
    same for two calls that Triton launches alike (a constexpr given by position or by name)."""
    signature = inspect.signature(kernel.fn)
    out = []
    for kind, grid, args, named in kernel.log:
        assert kind == "triton"
        params = signature.bind(*args, **{k: v for k, v in named.items() if k in signature.parameters})
        out.append((grid, dict(params.arguments), {k: v for k, v in named.items() if k not in signature.parameters}))
    return out


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


def streams_entered(kernel, monkeypatch) -> list:
    """Each torch.cuda.stream(s) entered from now on, as (s, how many calls had reached kernel[grid])."""
    entered = []

    def stream(s):
        entered.append((s, len(kernel.log)))
        return contextlib.nullcontext()
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return entered


def test_installed_triton_takes_the_direct_launch(recwarn):
    """The Triton installed here is one pyproject.toml allows, so one the direct launch is used with."""
    assert launch._INTERNALS_IMPORT_ERROR is None
    assert launch._FastPath(triton.__version__).accepts(FakeCompiled([]))
    assert len(recwarn) == 0


@pytest.mark.parametrize("version,direct", [
    ("3.6.0", True), ("3.9.1", True), ("3.6.0+git1a2b3c4", True),
    ("3.7.0", False), ("3.5.1", False), ("3.10.0", False), ("4.0.0", False), ("main", False)])
def test_direct_launch_only_on_a_tested_triton(version, direct, recwarn):
    fast_path = launch._FastPath(version)
    assert fast_path.accepts(None) is False  # the interpreter's: nothing to launch directly, nothing decided
    assert len(recwarn) == 0
    for _ in range(3):  # decided once, warned once
        assert fast_path.accepts(FakeCompiled([])) is direct
    assert len(recwarn) == (0 if direct else 1)
    if not direct:
        assert f"Triton {version}:" in str(recwarn[0].message) and "tested only with Triton 3.6, 3.9" in str(
            recwarn[0].message)


def test_untested_triton_launches_through_kernel_grid_with_one_warning(kernel, monkeypatch):
    """Every launch, the launcher's and a bound one's (on its stream), is the kernel[grid] call it stands for."""
    monkeypatch.setattr(launch, "TESTED_TRITON_VERSIONS", frozenset())
    entered = streams_entered(kernel, monkeypatch)
    launcher, reference = CachedLauncher(kernel), FakeKernel()
    x, y, x2 = torch.zeros(64), torch.zeros(64), torch.zeros(32)
    side = types.SimpleNamespace(cuda_stream=777)
    with pytest.warns(RuntimeWarning) as record:
        for grid in ((4,), (4, 2)):
            launcher(grid, x, y, 100, 64, BLOCK=128, num_warps=4)
            reference[grid](x, y, 100, 64, BLOCK=128, num_warps=4)
        bound = launcher.call_and_bind((4,), x, y, 100, 64, BLOCK=128, num_warps=4, variable=("x_ptr", "n"))
        reference[(4,)](x, y, 100, 64, BLOCK=128, num_warps=4)
        bound((2,), x2, 7)
        reference[(2,)](x2, y, 7, 64, BLOCK=128, num_warps=4)
        bound((3,), x2, 8, stream=side)
        reference[(3,)](x2, y, 8, 64, BLOCK=128, num_warps=4)
    assert kinds(kernel) == ["triton"] * 5 and launcher._compiled == {} and bound._compiled is None
    assert calls(kernel) == calls(reference)
    assert entered == [(None, 3), (side, 4)]  # the bound calls, each on its stream
    assert len(record) == 1 and f"Triton {TESTED}: the direct launch was tested only with" in str(record[0].message)


def test_direct_launch_that_raises_falls_back_to_kernel_grid_with_one_warning(kernel, monkeypatch):
    launcher, other_kernel, reference = CachedLauncher(kernel), FakeKernel(), FakeKernel()
    other = CachedLauncher(other_kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((4,), x, y, 100, 64, BLOCK=128, num_warps=4)
    other((1,), x, y, 5, 64, BLOCK=16)
    assert launcher._compiled and other._compiled  # both cached while the direct launch worked

    def changed_signature(self, grid):  # as a CompiledKernel whose launcher takes other arguments
        raise TypeError("run() takes 9 positional arguments but 16 were given")
    monkeypatch.setattr(FakeCompiled, "__getitem__", changed_signature)
    with pytest.warns(RuntimeWarning) as record:
        for grid in ((4, 2), (4, 2)):
            launcher(grid, x, y, 100, 64, BLOCK=128, num_warps=4)
            reference[grid](x, y, 100, 64, BLOCK=128, num_warps=4)
        other((1,), x, y, 5, 64, BLOCK=16)  # raises too: falls back, no second warning
        other((1,), x, y, 5, 64, BLOCK=16)
        third = CachedLauncher(FakeKernel())  # nothing is cached once the fast path is off
        third((1,), x, y, 5, 64, BLOCK=16)
        third((1,), x, y, 5, 64, BLOCK=16)
    assert kinds(kernel) == ["triton"] * 3 and calls(kernel)[1:] == calls(reference)
    assert kinds(other_kernel) == ["triton"] * 3 and kinds(third.kernel) == ["triton"] * 2
    assert launcher._compiled == {} and other._compiled == {} and third._compiled == {}
    assert len(record) == 1
    assert f"Triton {TESTED}: a direct launch raised TypeError" in str(record[0].message)


def test_bound_launch_that_raises_falls_back_to_kernel_grid_on_its_stream(kernel, monkeypatch):
    entered = streams_entered(kernel, monkeypatch)
    launcher, reference = CachedLauncher(kernel), FakeKernel()
    x, y, x2 = torch.zeros(64), torch.zeros(64), torch.zeros(32)
    bound = launcher.call_and_bind((4,), x, y, 100, 64, BLOCK=128, num_warps=4, variable=("x_ptr", "n"))
    reference[(4,)](x, y, 100, 64, BLOCK=128, num_warps=4)
    bound((2,), x2, 7)
    assert kinds(kernel) == ["triton", "cached"]
    del kernel.log[1]  # the direct launch: only the calls through kernel[grid] are compared below
    side = types.SimpleNamespace(cuda_stream=777)
    monkeypatch.setattr(launch, "knobs", types.SimpleNamespace())  # a Triton without knobs.runtime
    with pytest.warns(RuntimeWarning) as record:
        bound((3,), x2, 8, stream=side)
        reference[(3,)](x2, y, 8, 64, BLOCK=128, num_warps=4)
        bound((2,), x, 9)
        reference[(2,)](x, y, 9, 64, BLOCK=128, num_warps=4)
        launcher((1,), x, y, 100, 64, BLOCK=128, num_warps=4)  # the launcher's compiled kernel is dropped too
        reference[(1,)](x, y, 100, 64, BLOCK=128, num_warps=4)
    assert kinds(kernel) == ["triton"] * 4 and calls(kernel) == calls(reference)
    assert entered == [(side, 1), (None, 2)]  # each fallback on the bound call's stream
    assert bound._compiled is None and launcher._compiled == {}
    assert len(record) == 1
    assert f"Triton {TESTED}: a direct launch raised AttributeError" in str(record[0].message)


def test_launch_imports_and_falls_back_without_triton_internals(monkeypatch):
    """A Triton without the internals the direct launch uses (here: no triton.knobs): launch.py imports,
    and every launch goes through kernel[grid] after one warning."""
    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setitem(sys.modules, "triton.knobs", None)  # `from triton import knobs` raises ImportError
    spec = importlib.util.spec_from_file_location("launch_without_internals", launch.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.knobs is None and module.CompiledKernel is None
    kernel, x = FakeKernel(), torch.zeros(64)  # its kernel[grid] returns a compiled kernel
    launcher = module.CachedLauncher(kernel)
    with pytest.warns(RuntimeWarning) as record:
        launcher((1,), x, x, 1, 64, BLOCK=16)
        bound = launcher.call_and_bind((1,), x, x, 1, 64, BLOCK=16, variable=("n",))
        bound((1,), 2)
    assert kinds(kernel) == ["triton"] * 3
    assert len(record) == 1
    assert f"Triton {triton.__version__}: importing its internals failed" in str(record[0].message)
    assert "triton.knobs" in str(record[0].message)
