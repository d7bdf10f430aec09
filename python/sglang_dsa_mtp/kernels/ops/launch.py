"""Kernel launches that skip Triton's per-call dispatch once a call's plan is known.

:class:`LaunchPlans` keeps one plan per call key (scalar arguments, tunables, the ``id`` of each
buffer, held weakly: a plan dies with its buffers). The per-call inputs are the kernel's first
parameters, not specialized on alignment; a plan takes them 1-D, with its dtype, stride and device
and at least ``input_len`` entries. A key's first call goes through ``JITFunction.run``; later ones
call the compiled kernel's launcher directly, tensors as ``data_ptr()``: ``run(grid_x, grid_y,
grid_z, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*every_parameter_value)``, Triton's private interface, read for Triton 3.4 to 3.8
(:data:`DIRECT_LAUNCH_TRITON`); on Triton 3.6 and 3.8 (:data:`NATIVE_LAUNCH_TRITON`) a plan calls the
C function behind that launcher's Python ``__call__`` (its ``launch``) with the arguments the
``__call__`` would give it, where the kernel needs no scratch memory (:func:`native_launch`). Other
Tritons and the interpreter always take the JIT path, which :func:`launch_path` says in words
(``python -m sglang_dsa_mtp`` and the plugin's start-up line). Buffers resized or re-pointed in
place under a live plan are not supported. :meth:`LaunchPlans.planned` makes a function with the
wrapper's parameters that launches through the plan of its key, the key computed from its
parameters in its own frame (what the per-bs fallback installs for SGLang's keyword call);
:func:`bind` a function of the inputs alone, its key computed once (the MTP one launch's replay).
:func:`warm_up` compiles a call's variant on :func:`specialization_twin` buffers. Details:
docs/switches.md, "Host time".
"""

from __future__ import annotations

import inspect
import itertools
import operator
import typing
import weakref
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import triton

MISSING = type("Missing", (), {"__repr__": lambda self: "MISSING"})()  # an argument not passed
MAX_PLANS = 1024  # per kernel; past this many live plans, all are dropped and rebuilt on demand
# The Triton releases whose compiled-kernel launcher takes the arguments above, (major, minor).
DIRECT_LAUNCH_TRITON = ((3, 4), (3, 5), (3, 6), (3, 7), (3, 8))


def _triton_release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


TRITON_VERSION = triton.__version__  # the installed release, as read at import
TRITON_RELEASE = _triton_release(TRITON_VERSION)
DIRECT_LAUNCH = TRITON_RELEASE in DIRECT_LAUNCH_TRITON
# The releases whose CUDA launcher's ``__call__`` a plan steps over (:func:`native_launch`), each
# read for the arguments that ``__call__`` passes its C ``launch``.
NATIVE_LAUNCH_TRITON = ((3, 6), (3, 8))


def launch_path() -> str:
    """Which launch the plans make under the installed Triton (:data:`DIRECT_LAUNCH`, read when
    this module was imported), in words."""
    known = ", ".join(".".join(map(str, release)) for release in DIRECT_LAUNCH_TRITON)
    if DIRECT_LAUNCH:
        native = ", ".join(".".join(map(str, release)) for release in NATIVE_LAUNCH_TRITON)
        beneath = (
            f"; its C launch, known for {native}, is called beneath it"
            if TRITON_RELEASE in NATIVE_LAUNCH_TRITON
            else ""
        )
        return (
            f"direct: Triton {TRITON_VERSION}'s compiled-kernel launcher, without Triton's "
            f"per-call dispatch (its arguments known for Triton {known}{beneath})"
        )
    return (
        f"JIT path at every call (Triton {TRITON_VERSION}: the compiled-kernel launcher's "
        f"arguments are known for {known} only; the same kernels, with Triton's per-call dispatch "
        "on the host)"
    )


class Launch(NamedTuple):
    """One JIT launch of a plan's kernel, as a wrapper's checks make it: the grid, every kernel
    parameter by name (the per-call inputs among them), the fewest entries an input may have and
    Triton's launch options (``num_warps``)."""

    grid: tuple[int, ...]
    arguments: dict[str, Any]
    input_len: int
    options: dict[str, Any]


class _Plan:
    """One key's compiled kernel, grid and launch arguments (but the inputs), and the inputs'
    dtype, stride and device it takes."""

    __slots__ = (
        "compiled",
        "call",
        "before",
        "after",
        "quiet",
        "args_as_tuple",
        "grid",
        "device",
        "get_device",
        "get_stream",
        "input_specs",
        "input_len",
        "rest",
        "refs",
        "__weakref__",
    )

    def launch(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Launch with ``inputs`` when the plan takes them (1-D, its dtypes and strides, at least
        ``input_len`` entries, on its device, the current one); else False, nothing launched (also
        for inputs that are not tensors). The launch hooks and the stream are read at every call:
        a hook may be set, and the current stream changed, at any time."""
        device = self.device
        if self.get_device() != device:
            return False
        input_len = self.input_len
        pointers = []  # the inputs' addresses
        try:
            for tensor, (dtype, stride) in zip(inputs, self.input_specs):
                if (
                    tensor.dtype is not dtype
                    or tensor.stride() != stride  # a plan's input strides have one entry: 1-D,
                    or tensor.numel() < input_len  # so its element count is its length
                    or tensor.get_device() != device
                ):
                    return False
                pointers.append(tensor.data_ptr())
        except Exception:  # not a tensor: the wrapper's checks name it
            return False
        stream = self.get_stream(device)
        runtime = triton.knobs.runtime  # (Triton 3.8: hooks are plain attributes, no env lookup)
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        if (
            type(enter) is _HookChain  # Triton's default, checked inline: two empty hook chains
            and not enter.calls
            and type(exit_) is _HookChain
            and not exit_.calls
        ):  # no hook: the launch's fixed arguments as made once
            if self.args_as_tuple:
                self.call(*self.grid, stream, *self.quiet, (*pointers, *self.rest))
            else:
                self.call(*self.grid, stream, *self.quiet, *pointers, *self.rest)
            return True
        enter, exit_ = _live_hook(enter), _live_hook(exit_)
        if enter is None and exit_ is None:  # nothing to call: the metadata would go unread
            metadata = None
        else:
            metadata = self.compiled.launch_metadata(self.grid, stream, *pointers, *self.rest)
        if self.args_as_tuple:  # Triton 3.8's C launch: the kernel's arguments as one tuple
            self.call(
                *self.grid,
                stream,
                *self.before,
                metadata,
                enter,
                exit_,
                *self.after,
                (*pointers, *self.rest),
            )
        else:
            self.call(
                *self.grid,
                stream,
                *self.before,
                metadata,
                enter,
                exit_,
                *self.after,
                *pointers,
                *self.rest,
            )
        return True


# Triton's launch hook chain (Triton 3.5 on), None where it has none.
_HookChain = getattr(getattr(triton, "knobs", None), "HookChain", None)


def _live_hook(hook):
    """A launch hook as the launcher takes it: None where nothing would be called (no hook, or
    Triton 3.8's ``HookChain`` with no hook in it; the launcher calls a hook unless it is None)."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


class LaunchPlans:
    """Cached launches of one ``@triton.jit`` kernel whose first ``num_inputs`` parameters are the
    per-call inputs (1-D integer tensors) and whose other arguments are fixed per call key.

    ``wrapper`` is the function that launches the kernel; its parameters named as the kernel's
    inputs are the per-call inputs, and its type hints say how :meth:`key` takes every other one.
    ``prepare`` makes a call's :class:`Launch` from the wrapper's arguments by name, checking every
    one (a clear error naming the argument), or returns None when the call needs no kernel (it did
    its work itself). ``tunables`` returns the module constants a launch also depends on (tile
    sizes, stages, warps), read at every call: part of every key."""

    def __init__(
        self,
        kernel,
        num_inputs: int,
        *,
        wrapper: Callable | None = None,
        prepare: Callable[[Mapping[str, Any]], Launch | None] | None = None,
        tunables: Callable[[], tuple] = tuple,
        driver=None,
    ):
        self.kernel = kernel
        self.num_inputs = num_inputs
        self.wrapper = wrapper
        self.prepare = prepare
        self.tunables = tunables
        self.driver = driver  # None: Triton's active driver, looked up when a plan is made
        self.input_names = tuple(kernel.arg_names[:num_inputs])
        self._inputs = _tuple_getter(list(self.input_names))
        self._plans: dict[tuple, _Plan] = {}
        self._keyed = None
        if wrapper is not None:
            self._keyed = _keyed_parameters(wrapper, kernel, num_inputs)
            self._key = _compile(f"lambda a: {self.key_source(_by_name)}", self._namespace())
            wrapper.launch_plans = self  # the per-bs fallback finds the plans of the wrapper

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()

    def __call__(self, arguments: Mapping[str, Any]) -> None:
        """One call of the wrapper, from its arguments by name (its ``locals()`` on entry): through
        the plan of its key when there is one that takes its inputs; else checked and launched by
        ``prepare`` and Triton's JIT, which keeps a plan for the key."""
        if self.launch_planned(arguments):
            return
        launch = self.prepare(arguments)
        if launch is not None:
            self.launch(self.key(arguments), launch)

    def launch_planned(self, arguments: Mapping[str, Any]) -> bool:
        """Launch one call of the wrapper (its arguments by name) through the plan of its key, if
        there is one that takes its inputs; else False, nothing launched. An argument that makes no
        key, or is missing, takes no plan: the wrapper's checks name it."""
        try:
            plan = self._plans.get(self.key(arguments))
            inputs = self._inputs(arguments)
        except (TypeError, KeyError):
            return False
        return plan is not None and plan.launch(inputs)

    def key(self, arguments: Mapping[str, Any]) -> tuple:
        """The plan key of one call of the wrapper, from its arguments by name: every argument but
        the per-call inputs, a tensor (hinted ``torch.Tensor`` or ``Optional[torch.Tensor]``) by
        its identity, a scalar (``int``, ``bool``, ...) by value, a sequence of tuples of tensors
        (``Sequence[...]``) by the identity of each tensor, with one entry per item (its length);
        then the tunables. Made by :meth:`key_source`, as every key is."""
        if self._keyed is None:
            raise TypeError("these launch plans were made without a wrapper: they make no keys")
        return self._key(arguments)

    def key_source(self, ref: Callable[[str], str]) -> str:
        """The one place a key is made (no argument a launch depends on can be left out of it):
        the key as a Python tuple expression, each of the wrapper's arguments written as
        ``ref(name)``, evaluated in :meth:`_namespace`."""
        by_value, by_identity, nested = self._keyed
        parts = [ref(name) for name in by_value]
        parts += [f"_id({ref(name)})" for name in by_identity]
        parts += [f"_sequence_key({ref(name)})" for name in nested]
        return f"({', '.join([*parts, '*_tunables()'])},)"

    def _namespace(self) -> dict:
        return dict(_id=id, _sequence_key=_sequence_key, _tunables=self.tunables)

    def planned(self, on_miss: Callable[..., Any], *, unless: Container = ()) -> Callable | None:
        """A function with the wrapper's parameters (and ``**rest``) that launches a call through
        the plan of its key, the key and the inputs read from its own parameters (no dict, no
        second frame), and otherwise returns ``on_miss(rest, **arguments)``: no plan for the key,
        inputs the plan does not take, keywords the wrapper does not have, a ``bs`` in ``unless``,
        or anything raised on the way (``on_miss`` makes the call again, and meets it again).
        Every parameter defaults to :data:`MISSING`, which ``on_miss`` receives for an argument
        not passed (the key takes the wrapper's default for it). None where the wrapper's body is
        not ``plans(locals())``, which the function stands in for."""
        if not _body_calls(self.wrapper, self):
            return None
        parameters = _parameters(self.wrapper)
        if "bs" not in parameters:
            raise ValueError(f"{self.wrapper.__name__} has no bs parameter for unless")
        defaults = {name: p.default for name, p in parameters.items() if p.default is not p.empty}

        def ref(name: str) -> str:  # an argument left out keys as the wrapper's default
            if name in defaults:
                return f"(_default_{name} if {name} is _MISSING else {name})"
            return name

        signature = ", ".join(f"{name}=_MISSING" for name in parameters)
        arguments = ", ".join(f"{name}={name}" for name in parameters)
        inputs = ", ".join(self.input_names)
        source = f"""def {self.wrapper.__name__}({signature}, **rest):
    if not rest and bs not in _unless:
        try:
            _plan = _owner._plans.get({self.key_source(ref)})
            if _plan is not None and _plan.launch(({inputs},)):
                return None
        except Exception:
            pass  # on_miss makes the same call and meets what was raised
    return _on_miss(rest, {arguments})
"""
        namespace = self._namespace()
        namespace.update(_owner=self, _unless=unless, _on_miss=on_miss, _MISSING=MISSING)
        namespace.update({f"_default_{name}": value for name, value in defaults.items()})
        exec(compile(source, f"<planned {self.wrapper.__name__}>", "exec"), namespace)
        function = namespace[self.wrapper.__name__]
        function.__doc__ = self.wrapper.__doc__
        function.launch_plans = self
        return function

    def bind(self, **fixed) -> Callable[..., None]:
        """The wrapper's call with ``fixed`` (every argument but the inputs) as a function of the
        inputs, by position: through the plan of the key those arguments make (computed once: the
        bound function holds them, so their identities stay theirs), else the wrapper's call."""
        wrapper, tunables = self.wrapper, self.tunables
        names = self.input_names
        arguments = dict(fixed)
        for name, p in _parameters(wrapper).items():
            if name not in names and name not in arguments and p.default is not p.empty:
                arguments[name] = p.default
        key = self.key(arguments)
        head = key[: len(key) - len(tunables())]  # the key but its tunables, read at each call

        def bound(*inputs) -> None:
            plan = self._plans.get((*head, *tunables()))
            if plan is None or not plan.launch(inputs):
                wrapper(**dict(zip(names, inputs)), **fixed)

        bound.fixed = fixed
        return bound

    def launch(self, key: tuple, launch: Launch) -> None:
        """Launch through Triton's JIT, ``kernel[grid](**arguments, **options)``, then keep a plan
        for ``key`` (the caller has checked every argument; every tensor argument but the inputs is
        a buffer the plan holds weakly)."""
        compiled = self.kernel[launch.grid](**launch.arguments, **launch.options)
        if not DIRECT_LAUNCH or not _is_compiled_kernel(compiled):
            return  # another Triton, the interpreter, or an asynchronous compile: the JIT path
        names = self.kernel.arg_names
        values = [launch.arguments[name] for name in names]
        inputs = values[: self.num_inputs]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in inputs):
            return  # a plan takes 1-D inputs only
        plan = _Plan()
        plan.compiled = compiled
        native = native_launch(compiled.run)
        plan.call, between, plan.after, plan.args_as_tuple = native or (compiled.run, (), (), False)
        plan.before = (compiled.function, *between, compiled.packed_metadata)
        plan.quiet = (*plan.before, None, None, None, *plan.after)  # no metadata, no hooks
        plan.grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        active = self.driver or triton.runtime.driver.active
        plan.get_device = _current_device_getter(active)
        plan.get_stream = active.get_current_stream
        plan.device = plan.get_device()
        plan.input_specs = tuple((t.dtype, t.stride()) for t in inputs)
        plan.input_len = launch.input_len
        plan.rest = tuple(_addresses(v) for v in values[self.num_inputs :])
        self._store(key, plan, list(_tensors(values[self.num_inputs :])))

    def _store(self, key: tuple, plan: _Plan, buffers: Sequence[torch.Tensor]) -> None:
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        plans, plan_ref = self._plans, weakref.ref(plan)

        def drop(_):
            if plans.get(key) is plan_ref():
                plans.pop(key, None)

        plan.refs = tuple(weakref.ref(b, drop) for b in buffers)
        plans[key] = plan


def native_launch(launcher) -> tuple | None:
    """The C function behind a compiled kernel's launcher (its ``run``) and what its Python
    ``__call__`` passes it around a launch's own arguments, where a plan may call it in the
    launcher's place: ``(launch, between, after, args_as_tuple)``, the launch called as
    ``launch(grid_x, grid_y, grid_z, stream, function, *between, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *after, *arguments)``, or with ``args_as_tuple`` (Triton 3.8) the
    arguments as one tuple in their place (``run`` itself takes this call with ``between`` and
    ``after`` empty). Only for Triton's CUDA launcher of a release in :data:`NATIVE_LAUNCH_TRITON`,
    for a kernel without scratch memory (whose ``__call__`` allocates nothing, passing None for it)
    and without Triton 3.8's global sanitizer; else None, and the plan calls the launcher."""
    if (
        TRITON_RELEASE not in NATIVE_LAUNCH_TRITON
        or type(launcher).__name__ != "CudaLauncher"
        or type(launcher).__module__ != "triton.backends.nvidia.driver"
        or launcher.global_scratch_size
        or launcher.profile_scratch_size
        or getattr(launcher, "gsan_enabled", False)
    ):
        return None
    flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
    if TRITON_RELEASE == (3, 6):
        # __call__(grid, stream, function, *args) -> launch(grid, stream, function, cooperative,
        # pdl, global_scratch, profile_scratch, *args); args: metadata, hooks, then the kernel's.
        return launcher.launch, (*flags, None, None), (), False
    # 3.8: __call__(grid, stream, function, packed, metadata, enter, exit, *args) -> launch(grid,
    # stream, function, cooperative, pdl, packed, metadata, enter, exit, global_scratch,
    # profile_scratch, arg_annotations, kernel_signature, args)
    after = (None, None, launcher.arg_annotations, launcher.kernel_signature)
    return launcher.launch, flags, after, True


def _current_device_getter(active):
    """The driver's current-device query: torch's ``_cuda_getDevice`` where the driver uses
    ``torch.cuda.current_device``, which checks CUDA's lazy initialization at every call (a plan
    exists only after a launch: CUDA is initialized)."""
    getter = active.get_current_device
    return torch._C._cuda_getDevice if getter is torch.cuda.current_device else getter


_SCALARS = (int, bool, float, str, type(None))


def _parameters(wrapper) -> Mapping[str, inspect.Parameter]:
    """``wrapper``'s parameters, each one nameable (a wrapper is called by keyword)."""
    parameters = inspect.signature(wrapper).parameters
    nameable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    odd = [name for name, p in parameters.items() if p.kind not in nameable]
    if odd:
        raise ValueError(f"{wrapper.__name__} has parameters that cannot be named: {odd}")
    return parameters


def _keyed_parameters(wrapper, kernel, num_inputs: int) -> tuple[list, list, list]:
    """The names of ``wrapper``'s parameters but the kernel's inputs, split by their type hints:
    (scalars, tensors, sequences)."""
    inputs = kernel.arg_names[:num_inputs]
    hints = typing.get_type_hints(wrapper)
    names = list(_parameters(wrapper))
    missing = [name for name in inputs if name not in names]
    if missing:
        raise ValueError(f"{wrapper.__name__} has no parameter for the kernel inputs {missing}")
    groups = ([], [], [])
    for name in names:
        if name in inputs:
            continue
        hint = hints.get(name, object)
        options = set(typing.get_args(hint)) or {hint}
        if options <= {torch.Tensor, type(None)} and torch.Tensor in options:
            groups[1].append(name)
        elif options <= set(_SCALARS):
            groups[0].append(name)
        else:
            groups[2].append(name)
    return groups


def bind(function: Callable, inputs: Sequence[str], **fixed) -> Callable[..., None]:
    """``function(**fixed)`` with the ``inputs`` (names) passed at each call, by position: for a
    wrapper with launch plans whose inputs those are, :meth:`LaunchPlans.bind` (its key computed
    once), else a plain call of ``function`` by keyword."""
    plans = getattr(function, "launch_plans", None)
    if (
        isinstance(plans, LaunchPlans)
        and plans.wrapper is function
        and _body_calls(function, plans)
        and tuple(inputs) == plans.input_names
    ):
        return plans.bind(**fixed)
    names = tuple(inputs)

    def call(*values) -> None:
        function(**dict(zip(names, values)), **fixed)

    return call


class _Every:
    """A container of everything: a planned function given it as ``unless`` takes no plan."""

    def __contains__(self, item) -> bool:
        return True


EVERY = _Every()


def set_unless(planned, unless: Container) -> None:
    """What a :meth:`LaunchPlans.planned` function sends to its ``on_miss`` from now on: the calls
    whose ``bs`` is in ``unless`` (:data:`EVERY`: every call)."""
    planned.__globals__["_unless"] = unless


def _body_calls(wrapper, plans: LaunchPlans) -> bool:
    """Whether ``wrapper``'s body is ``plans(locals())`` and nothing else (the names it reads are
    the plans' and ``locals``): what :meth:`LaunchPlans.planned` stands in for."""
    names = wrapper.__code__.co_names
    return len(names) == 2 and names[1] == "locals" and wrapper.__globals__.get(names[0]) is plans


def _by_name(name: str) -> str:
    return f"a[{name!r}]"


def _compile(source: str, namespace: dict):
    return eval(compile(source, "<launch plan key>", "eval"), namespace)


def _tuple_getter(names: list[str]) -> Callable[[Mapping[str, Any]], tuple]:
    if len(names) >= 2:
        return operator.itemgetter(*names)
    if names:
        name = names[0]
        return lambda arguments: (arguments[name],)
    return lambda arguments: ()


def _sequence_key(value) -> tuple:
    """A sequence of tuples of tensors (or None) as a key part: its length, then the identity of
    every item's every entry."""
    return (len(value), *map(id, itertools.chain.from_iterable(value)))


def _addresses(arg):
    """``arg`` as the launcher takes it: a tensor as its address, a tuple element by element."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if isinstance(arg, tuple):
        return tuple(_addresses(item) for item in arg)
    return arg


def _tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, tuple):
            yield from _tensors(arg)


def _is_compiled_kernel(kernel) -> bool:
    return all(
        hasattr(kernel, name) for name in ("run", "function", "packed_metadata", "launch_metadata")
    )


def specialization_twin(tensor: torch.Tensor, *, shared_rows: bool = False) -> torch.Tensor:
    """A fresh zero tensor that Triton specializes on as on ``tensor``: the same dtype, device, shape
    and strides, and the same address modulo 16 (Triton's pointer alignment specialization).

    With ``shared_rows`` (2-D) the dim-0 stride is 0 and every row is the same storage: for tables
    whose row stride a kernel does not specialize on (the same ``i32`` argument type as any row stride
    below 2**31), so that a twin of a context-wide table costs one row.
    """
    strides = (0, *tensor.stride()[1:]) if shared_rows else tensor.stride()
    if any(n == 0 for n in tensor.shape):
        span = 0
    else:
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, strides))
    item = tensor.element_size()
    offset = (tensor.data_ptr() % 16) // item
    storage = torch.zeros(span + offset + 16 // item, dtype=tensor.dtype, device=tensor.device)
    shift = (-storage.data_ptr() % 16) // item  # align the storage to 16 bytes, then offset
    return storage.as_strided(tuple(tensor.shape), strides, shift + offset)


# ----------------------------------------------------------------------------------------------
# Warm-up: compile a call's kernel variant ahead of the call
# ----------------------------------------------------------------------------------------------

# Context-wide tables: their twins share one row of storage (no kernel specializes on row strides).
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
    wrapper(**{name: _twin(name, value) for name, value in kwargs.items()})


def _twin(name: str, value):
    if name == "req_to_token" or not isinstance(value, (torch.Tensor, list, tuple)):
        return value
    if isinstance(value, (list, tuple)):  # MTP destinations: twin each buffer of each NamedTuple
        return [
            dest._replace(**{field: _twin(field, getattr(dest, field)) for field in dest._fields})
            for dest in value
        ]
    twin = specialization_twin(value, shared_rows=name in WIDE_TABLES)
    if name == "extend_seq_lens":
        twin.copy_(value)
    return twin
