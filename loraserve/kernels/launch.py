"""Cheap launches of Triton kernels from Python: argument binding once per specialization, plain-int grid math.

`kernel[grid](...)` binds and specializes every argument in Python on every
call (30-50 us on the GPU machine for a kernel of 15-37 arguments), which is
most of the host cost of an eager step and of capturing the CUDA graphs. A
`CachedLauncher` keys each call on what Triton specializes on (each tensor's
dtype and 16-byte alignment; each integer's value, or only its width for the
arguments marked do_not_specialize; every other argument's value, the launch
options included), asks Triton for the compiled kernel the first time it sees
a key, and afterwards launches that compiled kernel directly on Triton's
current device and stream. The key is finer than Triton's own specialization,
so the kernel launched is always the one Triton would have chosen. Under
TRITON_INTERPRET=1 every call goes through Triton (the interpreter compiles
nothing).

The cache is a memo of compiled kernels held by the launcher object, the same
kind of state as Triton's own per-kernel cache. It grows with distinct keys:
layer shapes and dtypes (a do_not_specialize'd token count stays one entry).

`cdiv` and `next_power_of_2` are the host-side grid helpers: triton's own are
constexpr functions, about 10 us per call from Python. `pdl_supported` says
whether a kernel may be launched as a programmatic dependent launch
(`launch_pdl=True`: it may start while the kernel before it in the stream
finishes; it must `gdc_wait()` before it reads anything that kernel writes);
`pdl_launch` gives the launch arguments.

`CachedLauncher.call_and_bind` returns a `BoundLaunch`: the same launch again
with only a few arguments given anew (for the LoRA kernels of every decode step,
whose buffers never change), which skips the argument list and key.

The direct launch is a micro-optimisation behind one documented seam with a
plain fallback: it drives Triton's internals (`CompiledKernel`, its `run`
launcher and `packed_metadata`, `driver.active`'s current stream, the launch
hooks in `knobs.runtime`), so it is used only on the Triton versions it was
tested with (`TESTED_TRITON_VERSIONS`) and only while it works. On any other
version, if those internals cannot be imported, or once a direct launch raises
what a changed internal raises (`_INTERNALS_CHANGED`), launches go through the
public `kernel[grid](...)` (the same kernels and results, the host cost of
Triton's own path) after one warning naming the Triton version and what failed.
`_fast_path` is the one switch; it costs nothing per launch (it is consulted
when a compiled kernel would be cached, and on a failure).
"""
from __future__ import annotations

import functools
import inspect
import re
import warnings

import torch
import triton

try:  # Triton's internals: only the direct launch uses them
    from triton import knobs
    from triton.compiler import CompiledKernel
    from triton.runtime import driver
except ImportError as error:
    knobs = CompiledKernel = driver = None
    _INTERNALS_IMPORT_ERROR: ImportError | None = error
else:
    _INTERNALS_IMPORT_ERROR = None

# The Triton releases (major, minor) the direct launch was tested with: 3.6 on the GPU (CUDA), 3.9 in the
# CPU tests (a stand-in compiled kernel). pyproject.toml allows 3.6 to 3.9; any other release, 3.7 and 3.8
# included, launches through kernel[grid].
TESTED_TRITON_VERSIONS = frozenset({(3, 6), (3, 9)})

# What a direct launch raises when Triton's internals changed under it (a renamed attribute, a new
# signature, a moved module). A launch that itself fails (RuntimeError, OutOfResources, a bad pointer's
# ValueError) would fail through kernel[grid] too: that propagates.
_INTERNALS_CHANGED = (AttributeError, TypeError, ImportError, KeyError, IndexError)

_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pdl_supported(t: torch.Tensor) -> bool:
    """Programmatic dependent launch (a kernel starting while the one before it finishes): Hopper and later."""
    return t.is_cuda and _major_capability(t.get_device()) >= 9


def pdl_launch(t: torch.Tensor, wanted: bool = True) -> dict:
    """Launch arguments of a kernel with a `PDL: tl.constexpr` that gdc_wait()s when it is set: a
    programmatic dependent launch where wanted and supported, a plain launch otherwise."""
    if wanted and pdl_supported(t):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)


@functools.lru_cache(maxsize=None)
def _major_capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


class _FastPath:
    """Whether compiled kernels are launched directly, through Triton's internals.

    Decided once, by the first compiled kernel (none under the interpreter), from
    the Triton version and the imports of the internals; turned off for good by
    the first direct launch that raises. Turning off warns once. Read only where a
    compiled kernel would be cached, never per launch: kernels cached while it was
    on stay with their launcher until a direct launch of that launcher raises.
    """

    def __init__(self, version: str, import_error: ImportError | None = None):
        self.version = version
        self._import_error = import_error
        self._on: bool | None = None  # None: not decided yet

    def accepts(self, compiled) -> bool:
        """Whether `compiled`, what kernel[grid] returned, may be cached and launched directly."""
        if compiled is None:  # the interpreter: nothing compiled, nothing to decide
            return False
        if self._on is None:
            self._on = True
            reason = self._ruled_out()
            if reason is not None:
                self.turn_off(reason)
        return self._on and isinstance(compiled, CompiledKernel)

    def _ruled_out(self) -> str | None:
        """Why the direct launch may not be used with this Triton at all, or None."""
        if self._import_error is not None:
            return f"importing its internals failed: {self._import_error!r}"
        match = re.match(r"(\d+)\.(\d+)", self.version)
        if match is None or (int(match[1]), int(match[2])) not in TESTED_TRITON_VERSIONS:
            tested = ", ".join(f"{major}.{minor}" for major, minor in sorted(TESTED_TRITON_VERSIONS))
            return f"the direct launch was tested only with Triton {tested}"
        return None

    def turn_off(self, reason: str) -> None:
        """Launch through kernel[grid] from now on; warns the first time."""
        if self._on is not False:
            warnings.warn(f"loraserve: Triton {self.version}: {reason}; launching kernels through "
                          "kernel[grid] (the same results, more host time per launch)", RuntimeWarning)
        self._on = False


_fast_path = _FastPath(triton.__version__, _INTERNALS_IMPORT_ERROR)  # the one switch of the direct launch


class CachedLauncher:
    """launcher(grid, *args, **named): the same as kernel[grid](*args, **named), cheaper after the first call."""

    def __init__(self, kernel):
        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)  # the Python function under triton.jit
        self.arg_names = tuple(inspect.signature(fn).parameters)
        self._arg_name_set = frozenset(self.arg_names)
        unspecialized = set(getattr(kernel, "do_not_specialize", ()) or ())
        self._unspecialized = tuple(i for i, name in enumerate(self.arg_names)
                                    if name in unspecialized or i in unspecialized)
        self._compiled: dict[tuple, CompiledKernel] = {}

    def _key_function(self, index: int, value):
        """The function giving what Triton specializes parameter `index` on, or finer (the part of
        `_compiled_for`'s key), for values of `value`'s kind."""
        if isinstance(value, torch.Tensor):
            return _tensor_key
        if index in self._unspecialized:
            return _int_width_key
        return _value_key

    def _launch_options(self, named: dict) -> dict:
        """The named arguments that are launch options (num_warps, ...), not kernel parameters."""
        return {k: v for k, v in named.items() if k not in self._arg_name_set}

    def _compiled_for(self, params: tuple, named: dict) -> tuple[tuple, CompiledKernel | None]:
        # _key_function of every parameter, spelled out: this runs on every launch
        key = [_tensor_key(v) if isinstance(v, torch.Tensor) else v for v in params]
        for i in self._unspecialized:
            key[i] = _int_width_key(key[i])
        key.append(tuple(self._launch_options(named).items()))
        key = tuple(key)
        return key, self._compiled.get(key)

    def __call__(self, grid: tuple[int, ...], *args, **named) -> None:
        self._launch(grid, args, named)

    def call_and_bind(self, grid: tuple[int, ...], *args, variable: tuple[str, ...], **named) -> "BoundLaunch":
        """Launch now, like __call__, and return a BoundLaunch that repeats this launch with the
        parameters named in `variable` given anew each time."""
        params, compiled = self._launch(grid, args, named)
        return BoundLaunch(self, params, self._launch_options(named), variable, compiled)

    def _launch(self, grid: tuple[int, ...], args: tuple, named: dict) -> tuple[tuple, CompiledKernel | None]:
        """Launch; returns every parameter in order and the compiled kernel (None under the interpreter)."""
        # params: every kernel parameter in order; the ones after the positional args come by name
        params = args + tuple(named[name] for name in self.arg_names[len(args):])
        key, compiled = self._compiled_for(params, named)
        if compiled is None:
            compiled = self.kernel[grid](*args, **named)  # binds, specializes, compiles if need be, launches
            if not _fast_path.accepts(compiled):
                return params, None
            self._compiled[key] = compiled
            return params, compiled
        try:
            compiled[_grid3(grid)](*params, stream=_current_stream())
        except _INTERNALS_CHANGED as error:
            self._direct_launch_failed(error)
            self.kernel[grid](*args, **named)
            return params, None
        return params, compiled

    def _direct_launch_failed(self, error: Exception) -> None:
        """A direct launch raised: turn the fast path off and drop the compiled kernels (launched no more)."""
        _fast_path.turn_off(f"a direct launch raised {error!r}")
        self._compiled.clear()


def _tensor_key(t: torch.Tensor) -> tuple:
    """What Triton specializes a tensor argument on: its dtype and 16-byte alignment."""
    return t.dtype, t.data_ptr() % 16 == 0


def _int_width_key(value: int) -> bool:
    """What Triton specializes a do_not_specialize'd integer on: whether it fits in int32."""
    return _INT32_MIN <= value <= _INT32_MAX


def _value_key(value):
    """What Triton specializes any other argument on (an integer's value, a constexpr): the value, or finer."""
    return value


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(grid) + (1,) * (3 - len(grid))


def _current_stream() -> int:
    """Triton's handle of the current stream (torch's current stream on the current device)."""
    return driver.active.get_current_stream(driver.active.get_current_device())


class BoundLaunch:
    """A kernel launch with fixed arguments but for a few (`variable`) given on each call.

    Meant for launches repeated many times with the same buffers (the LoRA kernels
    of a decode step and of every graph capture): a call checks only the variable
    arguments, and launches the compiled kernel directly while each keeps what
    Triton specializes on (a tensor's dtype and alignment; an integer's value, or
    its width if do_not_specialize). Otherwise, and under the interpreter, the
    call goes through the launcher.

    The direct launch hands Triton's launcher a ready argument list: every tensor
    as its device address (an int), which it takes as is; given the tensor it
    would call data_ptr() and ask the driver to check the pointer, about 1 us per
    tensor. The fixed tensors were checked by the first launch and are kept alive
    here, so their addresses stay valid (they must not be given new storage); a
    variable tensor must be a CUDA tensor. Variable tensors are not kept after
    the call. Launch hooks (a profiler's) and their metadata, built from the
    tensors as Triton would build it, are passed only while a hook is set. If the
    direct launch raises (`_INTERNALS_CHANGED`), this and every later call go
    through the launcher.
    """

    def __init__(self, launcher: CachedLauncher, params: tuple, options: dict, variable: tuple[str, ...],
                 compiled: CompiledKernel | None):
        self._launcher = launcher
        self._params = list(params)  # every parameter (tensors as tensors: the launcher's path, hooks)
        self._addresses = [p.data_ptr() if isinstance(p, torch.Tensor) else p for p in params]  # the direct launch's
        self._options = options
        # per variable parameter: (position, its key function, what the bound kernel was specialized on)
        positions = [launcher.arg_names.index(name) for name in variable]
        key_functions = [launcher._key_function(i, params[i]) for i in positions]
        self._variable = tuple((i, key_of, key_of(params[i])) for i, key_of in zip(positions, key_functions))
        for i, _, _ in self._variable:
            self._params[i] = None  # given on each call, not kept
        self._compiled = compiled

    def __call__(self, grid: tuple[int, ...], *values, stream: torch.cuda.Stream | None = None) -> None:
        """Launch on `stream` (default: the current stream) with the variable parameters set to `values`,
        in their order."""
        compiled, addresses = self._compiled, self._addresses
        same = compiled is not None
        for (i, key_of, key), value in zip(self._variable, values):
            same = same and key_of(value) == key
            addresses[i] = value.data_ptr() if key_of is _tensor_key else value
        if not same:
            self._through_launcher(grid, values, stream)
            return
        try:
            handle = stream.cuda_stream if stream is not None else _current_stream()
            enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
            if _hook_set(enter) or _hook_set(leave):
                metadata = compiled.launch_metadata(grid, handle, *self._with_values(values))
            else:  # no hook: none is called (the launcher would call an empty hook chain, twice per launch)
                enter = leave = metadata = None
            compiled.run(*_grid3(grid), handle, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                         *addresses)
        except _INTERNALS_CHANGED as error:
            self._launcher._direct_launch_failed(error)
            self._compiled = None
            self._through_launcher(grid, values, stream)

    def _with_values(self, values: tuple) -> list:
        """Every parameter, the variable ones set to `values` (tensors as tensors)."""
        params = list(self._params)
        for (i, _, _), value in zip(self._variable, values):
            params[i] = value
        return params

    def _through_launcher(self, grid: tuple[int, ...], values: tuple, stream: torch.cuda.Stream | None) -> None:
        with torch.cuda.stream(stream):  # None: a no-op, the current stream
            self._launcher(grid, *self._with_values(values), **self._options)


def _hook_set(hook) -> bool:
    """Whether a Triton launch hook is set: None, or an empty HookChain (newer Triton), means none."""
    return hook is not None and bool(getattr(hook, "calls", True))
