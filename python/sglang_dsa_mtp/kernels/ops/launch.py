"""Kernel launches bound once per captured batch size, and the twin buffers of warm-ups.

A replay-metadata wrapper checks its arguments, makes its kernel's grid and arguments (a
:class:`Launch`) and launches through Triton's JIT, ``kernel[grid](**arguments, **options)``.
:meth:`Binder.bind` makes a :class:`BoundLaunch` of one call's keyword arguments, at the capture of
a batch size, whose replays pass the same buffers: the compiled kernel of that call, its arguments
in the kernel's parameter order with the per-call inputs placed by parameter name, and the launcher
that a probe chose (:func:`choose_launcher`). A bound launch launches a later call only when every
other argument is the one it was bound with (a tensor by identity, a scalar by value) and its
inputs have the bound dtype, stride and device and enough entries; otherwise it launches nothing
and the wrapper takes the call. :func:`launch_path` says this in words. Details: docs/switches.md,
"Host time".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import triton

TRITON_VERSION = triton.__version__  # the installed release, as read at import

# Launchers, as the log and launch_path name them.
C_LAUNCH = "Triton's C launch"
TRITON_LAUNCH = "Triton's launch of the compiled kernel"
JIT = "Triton's JIT"


def launch_path() -> str:
    """How the bounded kernels' replays launch, in words."""
    return (
        "bound once per captured batch size at capture; a bound launch goes through "
        f"{TRITON_LAUNCH}, or through {C_LAUNCH} beneath it where a probe at capture found it "
        "writing every output bit for bit as Triton's JIT (per op and batch size); any other call "
        f"through the wrapper and {JIT} (Triton {TRITON_VERSION})"
    )


class Launch(NamedTuple):
    """One launch of a wrapper's kernel, as the wrapper's checks make it: the grid, every kernel
    parameter by name (the per-call inputs among them), the fewest entries an input may have and
    Triton's launch options (``num_warps``)."""

    grid: tuple[int, ...]
    arguments: dict[str, Any]
    input_len: int
    options: dict[str, Any]


_SCALARS = (int, bool, float, str)


class Binder:
    """How ``wrapper`` launches ``kernel``, for :meth:`bind`. The kernel's first ``num_inputs``
    parameters are the per-call inputs (1-D integer tensors, parameters of ``wrapper`` by the same
    names); ``prepare`` makes a call's :class:`Launch` from the wrapper's arguments by name, checking
    every one, or returns None when the call needs no kernel. ``what`` names the operation. The
    wrapper gets this binder as its ``binder`` attribute."""

    def __init__(self, what: str, kernel, num_inputs: int, prepare: Callable, wrapper: Callable):
        self.what, self.kernel, self.prepare, self.wrapper = what, kernel, prepare, wrapper
        self.inputs = tuple(kernel.arg_names[:num_inputs])
        self.signature = inspect.signature(wrapper)
        missing = [name for name in self.inputs if name not in self.signature.parameters]
        if missing:
            raise ValueError(f"{wrapper.__name__} has no parameter for the kernel inputs {missing}")
        wrapper.binder = self

    def arguments(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The wrapper's arguments by name for a call with ``kwargs``, defaults filled in."""
        call = self.signature.bind(**kwargs)
        call.apply_defaults()
        return dict(call.arguments)

    def bind(self, **kwargs) -> tuple[BoundLaunch | None, str]:
        """(the launch of a call with ``kwargs`` bound, or None; which launcher and why, in words).

        None where the call needs no kernel, where Triton compiles nothing here (its interpreter)
        or where no launcher wrote the probe's outputs as Triton's JIT did: the wrapper then takes
        every call. Raises what the wrapper's checks raise, and RuntimeError inside a CUDA stream
        capture (the probe launches)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("binding a launch probes it: call bind outside CUDA-graph capture")
        launch = self.prepare(self.arguments(kwargs))
        if launch is None:
            return None, f"{JIT}: the call needs no kernel"
        compiled = self.kernel.warmup(grid=launch.grid, **launch.arguments, **launch.options)
        if compiled is None:
            return None, f"{JIT}: Triton compiles nothing here (its interpreter)"
        for name in self.inputs:
            tensor = kwargs[name]
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                return None, f"{JIT}: {name} is not a 1-D tensor"
        slots = input_slots(self.kernel.arg_names, self.inputs)
        for name, slot in slots:  # the check before any launch: each input at its own parameter
            placed = self.kernel.arg_names[slot]
            if placed != name:
                return None, f"{JIT}: the input {name} would be placed at the parameter {placed}"
        launcher, why = choose_launcher(self, kwargs, launch, compiled, slots)
        if launcher is None:
            return None, why
        return BoundLaunch(self, kwargs, launch, slots, launcher), why


def input_slots(arg_names: list[str], inputs: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """Each per-call input with the position of the kernel parameter of its name."""
    return tuple((name, list(arg_names).index(name)) for name in inputs)


class BoundLaunch:
    """A call's kernel launch bound to its buffers (:meth:`Binder.bind`); ``launcher`` names the
    launcher. Calling it with a later call's keyword arguments launches that call and returns True
    when it takes it; else False, nothing launched."""

    __slots__ = (
        "binder",
        "launcher",
        "_launch",
        "_keywords",
        "_fixed",
        "_inputs",
        "_input_len",
        "_arguments",
        "_device",
    )

    def __init__(self, binder: Binder, kwargs: Mapping[str, Any], launch: Launch, slots, launcher):
        self.binder = binder
        self.launcher, self._launch = launcher  # (its name, the launch)
        self._keywords = frozenset(kwargs)
        self._fixed = tuple((n, v) for n, v in kwargs.items() if n not in binder.inputs)
        self._input_len = launch.input_len
        self._inputs = tuple(
            (name, slot, kwargs[name].dtype, kwargs[name].stride(), kwargs[name].device)
            for name, slot in slots
        )
        self._arguments = [launch.arguments[name] for name in binder.kernel.arg_names]
        device = kwargs[slots[0][0]].device
        self._device = device.index if device.type == "cuda" else None

    def __call__(self, kwargs: Mapping[str, Any]) -> bool:
        if kwargs.keys() != self._keywords:
            return False
        for name, value in self._fixed:
            given = kwargs[name]
            if given is not value and not (
                type(given) is type(value) and isinstance(value, _SCALARS) and given == value
            ):
                return False
        arguments = self._arguments.copy()
        for name, slot, dtype, stride, device in self._inputs:
            tensor = kwargs[name]
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dtype is not dtype
                or tensor.stride() != stride  # one entry: 1-D, so the length is the element count
                or tensor.numel() < self._input_len
                or tensor.device != device
            ):
                return False
            arguments[slot] = tensor
        if self._device is not None and _current_device() != self._device:
            return False
        self._launch(arguments)
        return True


# ----------------------------------------------------------------------------------------------
# Launchers and the probe that chooses one
# ----------------------------------------------------------------------------------------------


def triton_launch(compiled, grid: tuple[int, int, int]) -> Callable[[list], None]:
    """Triton's launch of ``compiled``: ``compiled[grid](*every_parameter_value)``, as
    ``JITFunction.run`` launches a compiled kernel (the launch hooks and the current stream read at
    every call)."""
    runner = compiled[grid]

    def launch(arguments: list) -> None:
        runner(*arguments)

    return launch


def c_launch(compiled, grid: tuple[int, int, int]) -> Callable[[list], None]:
    """The C function beneath Triton's CUDA launcher (``compiled.run``), called with the arguments
    that launcher's ``__call__`` gives it, without launch hooks (a call while a hook is set goes
    through :func:`triton_launch`). Raises LookupError where the launcher is not Triton's CUDA
    launcher or allocates memory per call (scratch memory, the global sanitizer). The two layouts
    are read from Triton 3.6 and 3.8 (told apart by the attributes 3.8 added); another release's
    fails the probe, the only user (:func:`choose_launcher`)."""
    launcher = compiled.run
    if type(launcher).__name__ != "CudaLauncher" or not type(launcher).__module__.startswith(
        "triton.backends.nvidia."
    ):
        raise LookupError(f"the launcher is a {type(launcher).__name__}, not Triton's CudaLauncher")
    if (
        getattr(launcher, "global_scratch_size", 1)
        or getattr(launcher, "profile_scratch_size", 1)
        or getattr(launcher, "gsan_enabled", False)
    ):
        raise LookupError("the launcher allocates memory per launch (scratch or sanitizer)")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        raise LookupError("this Triton has no triton.knobs.runtime launch hooks")
    flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
    function, packed = compiled.function, compiled.packed_metadata
    call, get_stream = launcher.launch, triton.runtime.driver.active.get_current_stream
    fallback = triton_launch(compiled, grid)
    if hasattr(launcher, "arg_annotations") and hasattr(launcher, "kernel_signature"):
        # 3.8: launch(grid, stream, function, cooperative, pdl, packed, metadata, enter, exit,
        # global_scratch, profile_scratch, arg_annotations, kernel_signature, args)
        head = (*flags, packed, None, None, None, None, None)
        tail = (launcher.arg_annotations, launcher.kernel_signature)

        def launch(arguments: list) -> None:
            if _hooked(runtime):
                fallback(arguments)
            else:
                stream = get_stream(_current_device())
                call(*grid, stream, function, *head, *tail, tuple(arguments))

        return launch
    # 3.6: launch(grid, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    # packed, metadata, enter, exit, *args)
    head = (*flags, None, None, packed, None, None, None)

    def spread(arguments: list) -> None:
        if _hooked(runtime):
            fallback(arguments)
        else:
            call(*grid, get_stream(_current_device()), function, *head, *arguments)

    return spread


def _current_device() -> int:
    """The current CUDA device, without ``torch.cuda.current_device``'s lazy-init check (a bound
    launch exists only after a launch: CUDA is initialized)."""
    return torch._C._cuda_getDevice()


def _hooked(runtime) -> bool:
    """Whether a launch hook is set: not None, and not Triton 3.8's empty ``HookChain``."""
    return any(
        hook is not None and getattr(hook, "calls", None) != []
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


# The launchers the probe tries, in order: the first that writes what Triton's JIT writes is bound.
LAUNCHERS = ((C_LAUNCH, c_launch), (TRITON_LAUNCH, triton_launch))
PROBE_MAX_LEN = 256  # the probe's per-call lengths and slots are below this (and the table sizes)
PROBE_COLUMNS = 4096  # row stride of the probe's twin page tables (the columns it may write)
POISON_BYTE = 0xA5  # every byte of the probe's outputs before its launches


def choose_launcher(binder: Binder, kwargs, launch: Launch, compiled, slots) -> tuple:
    """(the first of :data:`LAUNCHERS` whose bound launch of a call like ``kwargs`` on twin buffers
    writes every output bit for bit as ``kernel[grid](...)`` on twins of its own, or None; why, in
    words). The twins (:func:`probe_twins`) are poisoned alike and read the same seeded inputs,
    which differ from each other in every entry: inputs placed at each other's parameters write
    other outputs. A launcher that cannot be made, raises or writes otherwise is not chosen."""
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    try:
        inputs = probe_inputs(binder, kwargs, launch)
    except ValueError as exc:
        return None, f"{JIT}: no probe ({exc})"
    refused = []
    for name, make in LAUNCHERS:
        try:
            launcher = make(compiled, grid)
            why = _probe(binder, kwargs, launch, compiled, slots, (name, launcher), inputs)
        except Exception as exc:  # a launcher that does not work here is not chosen
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            return (name, launcher), f"{name}: {'; '.join([*refused, 'the probe matched'])}"
        refused.append(f"{name} not chosen ({why})")
    return None, f"{JIT}: {'; '.join(refused)}"


def _probe(binder: Binder, kwargs, launch: Launch, compiled, slots, launcher, inputs):
    """None where ``launcher``'s bound launch writes what Triton's JIT writes; else why not."""
    arms = [probe_twins(binder, kwargs, inputs) for _ in range(2)]
    launches = [binder.prepare(binder.arguments(arm)) for arm in arms]
    for twin in launches:
        if twin is None or twin.grid != launch.grid:
            return "the twin call launches another grid"
        found = binder.kernel.warmup(grid=twin.grid, **twin.arguments, **twin.options)
        if found is not compiled:
            return "the twin call specializes the kernel otherwise"
    if not BoundLaunch(binder, arms[0], launches[0], slots, launcher)(arms[0]):
        return "the bound launch refused the twin call"
    binder.kernel[launches[1].grid](**launches[1].arguments, **launches[1].options)
    if launch.arguments["req_to_token"].is_cuda:
        torch.cuda.synchronize()
    pairs = list(zip(_buffers(arms[0], binder.inputs), _buffers(arms[1], binder.inputs)))
    if all(bool((_bytes(jit) == POISON_BYTE).all()) for _, (_, jit) in pairs):
        return "Triton's JIT wrote no output: the probe tells nothing"
    for (name, bound), (_, jit) in pairs:
        if not torch.equal(_bytes(bound), _bytes(jit)):
            return f"{name} differs from Triton's JIT"
    return None


def probe_inputs(binder: Binder, kwargs, launch: Launch) -> dict[str, torch.Tensor]:
    """The probe's per-call inputs: twins of ``seq_lens`` and ``req_pool_indices`` holding seeded
    values in ``[0, min(req_to_token rows, width, PROBE_MAX_LEN))``, which differ from each other
    and from any other input (kept as given, as ``extend_seq_lens``) in every entry."""
    limit = min(launch.arguments["req_to_token"].shape[0], launch.arguments["width"])
    limit = min(limit, PROBE_MAX_LEN)
    seeded = [name for name in binder.inputs if name in ("seq_lens", "req_pool_indices")]
    kept = [kwargs[name].tolist() for name in binder.inputs if name not in seeded]
    if limit < len(seeded) + len(kept):
        raise ValueError(f"the probe needs {len(seeded) + len(kept)} distinct values below {limit}")
    order = torch.randperm(limit, generator=torch.Generator().manual_seed(0)).tolist()
    numel = max(kwargs[name].numel() for name in seeded)
    values = {name: [] for name in seeded}
    for i in range(numel):
        taken = {row[i] for row in kept if i < len(row)}
        picks = iter(v for j in range(limit) if (v := order[(i + j) % limit]) not in taken)
        for name in seeded:
            values[name].append(next(picks))
    inputs = {}
    for name in seeded:
        tensor = kwargs[name]
        twin = specialization_twin(tensor)
        twin.copy_(torch.tensor(values[name][: tensor.numel()], dtype=tensor.dtype))
        inputs[name] = twin
    return inputs


def probe_twins(binder: Binder, kwargs, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``kwargs`` with ``inputs`` for the seeded inputs, ``req_to_token`` itself (read-only) and
    every other buffer a :func:`specialization_twin`, each byte :data:`POISON_BYTE` (a context-wide
    table's rows :data:`PROBE_COLUMNS` apart: the probe's lengths write fewer columns)."""

    def twin(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in binder.inputs:
            return inputs.get(name, tensor)
        if name == "req_to_token":
            return tensor
        row_stride = None
        if name in WIDE_TABLES and tensor.dim() == 2:
            row_stride = min(tensor.stride(0), PROBE_COLUMNS)
        out = specialization_twin(tensor, row_stride=row_stride)
        _bytes(out).fill_(POISON_BYTE)
        return out

    return _map_buffers(kwargs, twin)


def _buffers(kwargs, inputs) -> list[tuple[str, torch.Tensor]]:
    """Every output buffer of a call's ``kwargs``, by name: not an input, not ``req_to_token``."""
    found = []
    _map_buffers(kwargs, lambda name, tensor: found.append((name, tensor)) or tensor)
    return [(n, t) for n, t in found if n not in inputs and n != "req_to_token"]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _map_buffers(kwargs: Mapping[str, Any], twin: Callable) -> dict[str, Any]:
    """``kwargs`` with every tensor replaced by ``twin(name, tensor)``, each buffer of a
    ``destinations`` list of NamedTuples field by field."""
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            out[name] = twin(name, value)
        elif isinstance(value, (list, tuple)):
            out[name] = [
                dest._replace(
                    **{
                        field: twin(field, tensor)
                        for field, tensor in zip(dest._fields, dest)
                        if isinstance(tensor, torch.Tensor)
                    }
                )
                for dest in value
            ]
        else:
            out[name] = value
    return out


# ----------------------------------------------------------------------------------------------
# Twin buffers; warm-up: compile a call's kernel variant ahead of the call
# ----------------------------------------------------------------------------------------------


def specialization_twin(tensor: torch.Tensor, *, row_stride: int | None = None) -> torch.Tensor:
    """A fresh zero tensor that Triton specializes on as on ``tensor``: the same dtype, device, shape
    and strides, and the same address modulo 16 (Triton's pointer alignment specialization).

    ``row_stride`` (2-D) replaces the dim-0 stride, for tables whose row stride a kernel does not
    specialize on (``do_not_specialize``): 0 makes every row the same storage (a twin of a
    context-wide table costs one row).
    """
    strides = tensor.stride() if row_stride is None else (row_stride, *tensor.stride()[1:])
    if any(n == 0 for n in tensor.shape):
        span = 0
    else:
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, strides))
    item = tensor.element_size()
    offset = (tensor.data_ptr() % 16) // item
    storage = torch.zeros(span + offset + 16 // item, dtype=tensor.dtype, device=tensor.device)
    shift = (-storage.data_ptr() % 16) // item  # align the storage to 16 bytes, then offset
    return storage.as_strided(tuple(tensor.shape), strides, shift + offset)


# Context-wide tables: their twins share rows of storage (no kernel specializes on row strides).
WIDE_TABLES = ("page_table_1", "real_page_table")


def warm_up(wrapper, **kwargs) -> None:
    """Compile (or find in Triton's cache) the kernel variant that ``wrapper(**kwargs)`` launches,
    without touching any buffer of ``kwargs``.

    ``wrapper`` is one of the replay-metadata wrappers (``dsa_metadata_bounded``'s three, or
    ``dsa_draft_decode_metadata.fused_dsa_draft_decode_metadata_multi``); ``kwargs`` are the keyword
    arguments of the real call. The call is made on :func:`specialization_twin` copies of every
    buffer (a ``destinations`` list is twinned field by field), with every request at length 0 in
    slot 0; ``extend_seq_lens`` keeps its values. ``req_to_token`` itself is passed (read-only): the
    kernels then read at most its first 128-column block of slot 0. Triton specializes on the twins
    as on the buffers, so the real call finds its kernel compiled. Must not run while a CUDA graph is
    captured (the launch would join the graph).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("warm_up launches a kernel: call it outside CUDA-graph capture")
    wrapper(**_map_buffers(kwargs, _twin))


def _twin(name: str, value: torch.Tensor) -> torch.Tensor:
    if name == "req_to_token":
        return value
    twin = specialization_twin(value, row_stride=0 if name in WIDE_TABLES else None)
    if name == "extend_seq_lens":
        twin.copy_(value)
    return twin
