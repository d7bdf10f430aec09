"""Tensor-parallel groups for the multi-process tests and benchmarks, one process per rank.

* Spawning: :func:`run_group` starts ``fn(rank, world, init_method, *args)`` in ``world`` processes
  (``fn`` a module-level function of an importable module); each rank writes ``rank<r>.json``, which
  :func:`read_reports` reads back. :func:`shared_hidden`: the same hidden states on every rank.
* SGLang's real TP group, built by SGLang's own code (:func:`sglang_parallel_groups`): its CPU form
  on gloo (:func:`sglang_tp_group`) and its GPU form for one all-reduce route of :data:`ROUTES`
  (:func:`sglang_nccl_tp_group`; :func:`route_group` for either). :class:`AllReduceRecorder` and
  :func:`route_taken` say which communicator ran each all-reduce; :func:`capture_replayer` captures
  a body as SGLang's graph runners do (on the CPU it runs eagerly, so that the same checks run in CI).
* A raw torch.distributed NCCL group (:func:`init_tp_group`), its all-gathers, and its two all-reduce
  arms (:func:`make_all_reduce`: NCCL, torch symmetric memory).
* The TP benchmarks' helpers: :func:`tp_size`, :func:`interleaved_times_us`, :func:`max_over_ranks`.

SGLang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from sglang_dsa_mtp.devices import select_device
from support.sglang_stubs import install_native_stubs
from support.timing import replay_us

SLEEP_CYCLES = 2_000_000  # ~1 ms at 2 GHz: both hosts enqueue the timed replay meanwhile


# --- spawning a group of processes ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(fn: Callable, world: int, *args, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` spawned processes and wait.

    ``fn`` is pickled by its module's name: a module-level function of a module the children can
    import (they get this process's ``sys.path``). A process that raises makes this raise (with its
    traceback); the others are terminated. Past ``timeout_s`` every process still alive is
    terminated and TimeoutError is raised.
    """
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(
        fn, args=(world, init_method, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-process group did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def read_reports(result_dir: str, world: int) -> list[dict]:
    """The ``rank<r>.json`` reports the ranks of a :func:`run_group` wrote, one per rank that did."""
    return [
        json.loads(Path(result_dir, f"rank{rank}.json").read_text())
        for rank in range(world)
        if os.path.exists(Path(result_dir, f"rank{rank}.json"))
    ]


def shared_hidden(
    rows: int, hidden: int, *, seed: int, dtype: torch.dtype = torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """The same ``[rows, hidden]`` hidden states on every rank: drawn on the CPU from a shared seed
    (normal), then ``dtype``, then ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=gen).to(dtype).to(device)


# --- SGLang's real TP group: CPU (gloo) and GPU (one all-reduce route) ------------------------------


@contextlib.contextmanager
def sglang_parallel_groups(
    rank: int,
    world: int,
    init_method: str,
    *,
    backend: str,
    server_args: Optional[dict] = None,
    group_kwargs: Optional[dict] = None,
):
    """SGLang's distributed environment and model-parallel groups, built as SGLang builds them.

    Publishes a dummy SGLang config with ``tp_size=world`` and ``server_args`` (real
    ``ServerArgs`` fields, e.g. ``disable_custom_all_reduce=True``) through
    ``get_context().override_server_args``; overrides ``tp_rank`` (the override publishes no
    ranks); sets SGLang's all-reduce switches from that config with SGLang's own
    ``bootstrap._set_all_reduce_flags`` (``set_custom_all_reduce``, ``set_mscclpp``,
    ``set_torch_symm_mem_all_reduce``, FlashInfer's all-reduce-only tag), restoring them on exit;
    then ``init_distributed_environment(backend=backend)`` with ``local_rank=rank`` and
    ``initialize_model_parallel(backend=backend, enable_symm_mem=...)`` as
    ``bootstrap._init_parallel_groups`` calls them. ``group_kwargs`` are forced on every group
    ``initialize_model_parallel`` builds (the CPU harness turns pynccl and the custom all-reduce
    off). Yields SGLang's TP ``GroupCoordinator``; on exit the groups, WORLD and the process group
    are destroyed and the previous config is restored.
    """
    from sglang.srt.distributed import bootstrap, parallel_state
    from sglang.srt.runtime_context import get_context, get_exec, get_parallel

    build_group = parallel_state.init_model_parallel_group

    def build_forced_group(*args, **kwargs):
        kwargs.update(group_kwargs)
        return build_group(*args, **kwargs)

    flags = [
        "_ENABLE_CUSTOM_ALL_REDUCE",
        "_ENABLE_MSCCLPP",
        "_ENABLE_TORCH_SYMM_MEM_ALL_REDUCE",
        "_ENABLE_FLASHINFER_ALLREDUCE_ONLY",
    ]
    saved_flags = {name: getattr(parallel_state, name) for name in flags}
    override = get_context().override_server_args(tp_size=world, **(server_args or {}))
    override.install()
    try:
        with get_parallel().override(tp_rank=rank):
            try:
                bootstrap._set_all_reduce_flags()
                parallel_state.init_distributed_environment(
                    world_size=world,
                    rank=rank,
                    local_rank=rank,
                    distributed_init_method=init_method,
                    backend=backend,
                )
                if group_kwargs:
                    parallel_state.init_model_parallel_group = build_forced_group
                try:
                    parallel_state.initialize_model_parallel(
                        backend=backend, enable_symm_mem=get_exec().comm.enable_symm_mem
                    )
                finally:
                    parallel_state.init_model_parallel_group = build_group
                yield get_parallel().tp_group
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
                for name, value in saved_flags.items():
                    setattr(parallel_state, name, value)
    finally:
        override.restore()


@contextlib.contextmanager
def sglang_tp_group(rank: int, world: int, init_method: str):
    """SGLang's TP group of ``world`` CPU processes on gloo, this process being ``rank``.

    Call it first in a spawned child: it selects the device (``TRITON_INTERPRET=1`` without CUDA)
    before anything imports SGLang or Triton. Yields SGLang's TP ``GroupCoordinator``, built by
    :func:`sglang_parallel_groups` on gloo with ``use_pynccl=False, use_custom_allreduce=False``
    forced on every group (a CUDA build of torch finds libnccl and PyNccl then asks for a CUDA
    device; the custom all-reduce only warns). ``LOCAL_SIZE`` is dropped from the environment so
    that SGLang's CPU shared-memory collectives (``sgl_kernel.shm_*``) stay off and CPU tensors go
    through gloo.
    """
    if select_device().type != "cpu":
        raise RuntimeError("sglang_tp_group builds a CPU (gloo) group; this machine has CUDA")
    os.environ.pop("LOCAL_SIZE", None)
    with sglang_parallel_groups(
        rank,
        world,
        init_method,
        backend="gloo",
        group_kwargs=dict(use_pynccl=False, use_custom_allreduce=False),
    ) as group:
        yield group


@dataclass(frozen=True)
class Route:
    """One way SGLang can be told to all-reduce: its ServerArgs fields (as the command-line
    ``flags`` set them), environment variables, and native packages it needs."""

    name: str
    flags: str
    server_args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    needs: tuple[str, ...] = ()


# The ways SGLang 0.5.23 can be configured to all-reduce a TP tensor inside a CUDA-graph capture,
# set through SGLang's own switches:
# * custom-ar-v2: SGLang's defaults on CUDA: the custom all-reduce V2 (a JIT kernel built through
#   tvm_ffi and nvcc from sources inside SGLang's wheel), where the GPUs qualify (all NVLink);
# * custom-ar-legacy: SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0, the legacy custom all-reduce
#   (sgl_kernel's native kernel);
# * torch-symm-mem: --disable-custom-all-reduce --enable-torch-symm-mem;
# * pynccl: --disable-custom-all-reduce (pynccl, enabled inside graph_capture());
# * symm-mem-pynccl: --disable-custom-all-reduce --enable-symm-mem.
# CPU_ROUTE ("gloo") is the CPU form (gloo, no device communicators), for CI.
ROUTES = {
    route.name: route
    for route in (
        Route(
            "custom-ar-v2", "SGLang's defaults", env={"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1"}
        ),
        Route(
            "custom-ar-legacy",
            "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0",
            env={"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "0"},
            needs=("sgl_kernel",),
        ),
        Route(
            "torch-symm-mem",
            "--disable-custom-all-reduce --enable-torch-symm-mem",
            dict(disable_custom_all_reduce=True, enable_torch_symm_mem=True),
        ),
        Route("pynccl", "--disable-custom-all-reduce", dict(disable_custom_all_reduce=True)),
        Route(
            "symm-mem-pynccl",
            "--disable-custom-all-reduce --enable-symm-mem",
            dict(disable_custom_all_reduce=True, enable_symm_mem=True),
        ),
    )
}
GPU_ROUTES = tuple(ROUTES)
CPU_ROUTE = "gloo"


class RouteUnavailable(Exception):
    """The route cannot be built on this machine as users deploy it (a skip, not a failure)."""


@contextlib.contextmanager
def sglang_nccl_tp_group(rank: int, world: int, init_method: str, route: Route):
    """SGLang's TP group on GPU ``rank`` for ``route`` (NCCL, SGLang's device communicators);
    yields its ``GroupCoordinator``.

    Call it first in a spawned child. Stubs absent native packages that the harness never calls
    (:mod:`.sglang_stubs`), raises :class:`RouteUnavailable` when the route needs one of them, sets
    the route's environment, then builds the group with ``sglang_parallel_groups(backend="nccl")``
    and the route's server args: SGLang's own ``GroupCoordinator`` constructor creates pynccl, the
    custom all-reduce, torch symmetric memory (as the switches say and the machine allows)."""
    device = select_device()
    if device.type != "cuda":
        raise RuntimeError("sglang_nccl_tp_group needs CUDA GPUs")
    stubbed = install_native_stubs()
    missing = sorted(set(route.needs) & set(stubbed))
    if missing:
        raise RouteUnavailable(
            f"route {route.name} needs {', '.join(missing)}, which is not installed here"
        )
    os.environ.update(route.env)
    torch.cuda.set_device(rank)
    with sglang_parallel_groups(
        rank, world, init_method, backend="nccl", server_args=route.server_args
    ) as group:
        yield group


@contextlib.contextmanager
def route_group(rank: int, world: int, init_method: str, route_name: str):
    """``(group, device)``: :func:`sglang_nccl_tp_group` for a GPU route, the CPU (gloo) group of
    :func:`sglang_tp_group` for :data:`CPU_ROUTE`."""
    if route_name == CPU_ROUTE:
        with sglang_tp_group(rank, world, init_method) as group:
            yield group, torch.device("cpu")
        return
    with sglang_nccl_tp_group(rank, world, init_method, ROUTES[route_name]) as group:
        yield group, torch.device("cuda", rank)


def describe_communicators(group) -> dict:
    """The device communicators SGLang built for ``group``: type name (" (disabled)" when it
    turned itself off), or None."""

    def name(comm):
        if comm is None:
            return None
        # pynccl is disabled outside graph_capture() by design; ``available`` says it works.
        usable = getattr(comm, "available", not getattr(comm, "disabled", False))
        return type(comm).__name__ + ("" if usable else " (disabled)")

    return dict(
        custom_all_reduce=name(group.ca_comm),
        pynccl=name(group.pynccl_comm),
        torch_symm_mem=name(group.torch_symm_mem_comm),
        mscclpp=name(group.pymscclpp_comm),
        pcie_ipc=name(group.pcie_ipc_comm),
        flashinfer_workspace=group._fi_workspace_hint,
        symmetric_memory=bool(group.is_symmetric_memory_enabled()),
    )


def route_offered(route_name: str, communicators: dict) -> Optional[str]:
    """None when SGLang built what ``route_name`` asks for on this machine, enabled, else why not
    (e.g. torch symmetric memory disables itself without NVLink multicast)."""
    wanted = {
        "custom-ar-v2": ("custom_all_reduce", "CustomAllReduceV2"),
        "custom-ar-legacy": ("custom_all_reduce", "CustomAllreduce"),
        "torch-symm-mem": ("torch_symm_mem", "TorchSymmMemCommunicator"),
        "pynccl": ("pynccl", "PyNcclCommunicator"),
        "symm-mem-pynccl": ("pynccl", "PyNcclCommunicator"),
    }.get(route_name)
    if wanted is None:
        return None
    key, expected = wanted
    if communicators[key] != expected:
        return f"SGLang built {communicators[key]} for {key}, not {expected}, on this machine"
    if route_name == "symm-mem-pynccl" and not communicators["symmetric_memory"]:
        return "SGLang's symmetric memory is off"
    return None


class AllReduceRecorder:
    """Which communicator ran each all-reduce of ``group`` while :meth:`recording`.

    A context manager: on entry it wraps, on this group's instances, the all-reduce method of each
    device communicator SGLang built (custom all-reduce, pynccl in and out of place, torch symmetric
    memory, MSCCL++, PCIe IPC, quick all-reduce, FlashInfer), and ``torch.distributed.all_reduce`` on
    the group's device group; on exit it restores them. Each call is recorded as
    ``(route, capturing)``, the route named as ``integration.vocab_shard_exchange.all_reduce_route`` names
    its prediction."""

    _METHODS = (
        ("ca_comm", "custom_all_reduce", "custom"),
        ("pynccl_comm", "all_reduce", "pynccl"),
        ("pynccl_comm", "outplace_all_reduce", "pynccl out of place"),
        ("torch_symm_mem_comm", "all_reduce", "torch symmetric memory"),
        ("pymscclpp_comm", "all_reduce", "MSCCL++"),
        ("pcie_ipc_comm", "pcie_ipc_all_reduce", "PCIe IPC all-reduce"),
        ("qr_comm", "quick_all_reduce", "quick all-reduce"),
    )

    def __init__(self, group):
        self.group = group
        self.calls: Optional[list] = None
        self._undo: list[Callable[[], None]] = []

    def __enter__(self):
        import torch.distributed as dist

        for attr, method, kind in self._METHODS:
            comm = getattr(self.group, attr, None)
            if comm is not None:
                self._wrap(comm, method, kind, instance=True)
        self._wrap(self.group, "_flashinfer_allreduce", "FlashInfer all-reduce", instance=True)
        device_group = self.group.device_group
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if group is device_group:
                self._record("torch.distributed", tensor)
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        self._undo.append(lambda: setattr(dist, "all_reduce", original))
        return self

    def __exit__(self, *exc):
        while self._undo:
            self._undo.pop()()

    def _wrap(self, owner, method: str, kind: str, *, instance: bool) -> None:
        original = getattr(owner, method)

        def recorded(tensor, *args, **kwargs):
            self._record(kind, tensor)
            return original(tensor, *args, **kwargs)

        setattr(owner, method, recorded)
        self._undo.append(lambda: owner.__dict__.pop(method, None))

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        if self.calls is None:
            return
        capturing = tensor.is_cuda and torch.cuda.is_current_stream_capturing()
        self.calls.append((self._route_name(kind, tensor), capturing))

    def _route_name(self, kind: str, tensor: torch.Tensor) -> str:
        if kind == "custom":
            return f"custom all-reduce ({type(self.group.ca_comm).__name__})"
        if kind == "pynccl":
            if self.group.is_symmetric_memory_enabled():
                return "pynccl with symmetric memory (--enable-symm-mem)"
            return "pynccl (in place)"
        if kind == "torch.distributed":
            if tensor.is_cpu:
                return "CPU shared memory or torch.distributed"
            return "torch.distributed (NCCL)"
        return kind

    @contextlib.contextmanager
    def recording(self):
        """Yields the list the calls made inside the block are appended to."""
        self.calls = []
        try:
            yield self.calls
        finally:
            self.calls = None


def route_taken(calls: list, group, device: torch.device) -> str:
    """The route of the recorded calls made inside a CUDA-graph capture (on the CPU: all calls),
    ``"a; b"`` when they differ; with none, ``"none (one rank)"`` for a group of one rank (SGLang
    returns the input), else ``"none"``."""
    routes = sorted({route for route, capturing in calls if capturing or device.type != "cuda"})
    if routes:
        return "; ".join(routes)
    return "none (one rank)" if group.world_size == 1 else "none"


def capture_replayer(body: Callable[[], object], group, device: torch.device):
    """``replay()``: returns ``body``'s outputs after running it again.

    On CUDA, ``body`` is captured in a CUDA graph as SGLang's graph runners capture: inside SGLang's
    ``graph_capture()`` (which enters the custom all-reduce's capture mode and enables pynccl), two
    eager warm-ups each after a synchronize and a TP barrier, then ``torch.cuda.graph`` on the
    capture stream; leaving ``graph_capture()`` registers the custom all-reduce's graph inputs.
    ``replay()`` replays the graph and returns the captured outputs. On the CPU, ``body`` runs once
    now (as the capture) and ``replay()`` runs it again."""
    if device.type != "cuda":
        body()
        return body
    from sglang.srt.distributed.parallel_state import graph_capture

    graph = torch.cuda.CUDAGraph()
    with graph_capture() as context:
        for _ in range(2):
            torch.cuda.synchronize()
            group.barrier()
            body()
        with torch.cuda.graph(graph, stream=context.stream):
            outputs = body()
    torch.cuda.current_stream().wait_stream(context.stream)
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        return outputs

    return replay


# --- a raw torch.distributed NCCL group and its all-reduce arms --------------------------------------


def init_tp_group(rank: int, world: int, init_method: str) -> torch.device:
    """This process's GPU and an initialized NCCL default group (eager communicator)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=world, device_id=device
    )
    return device


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """``out[world * rows, ...]`` = every rank's ``tensor`` stacked along dim 0, on the default group
    (``all_gather_single`` where torch has it, else ``all_gather_into_tensor``)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, tensor)


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """``GroupCoordinator.all_gather(tensor, dim=-1)`` of SGLang 0.5.23, on the default group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    rows, width = tensor.shape
    out = torch.empty((world * rows, width), dtype=tensor.dtype, device=tensor.device)
    all_gather_flat(out, tensor.contiguous())
    return out.view(world, rows, width).movedim(0, 1).reshape(rows, world * width)


class ArmUnavailable(Exception):
    """The communication arm does not exist on this machine (a skip, not a failure): see
    :func:`symm_mem_unavailable`."""


def symm_mem_unavailable(device: torch.device, world: int) -> Optional[str]:
    """Why torch symmetric memory's one-shot all-reduce cannot exist here, or None.

    Two conditions only: this torch has no ``torch.ops.symm_mem.one_shot_all_reduce`` (a build
    without symmetric memory), or this rank's GPU cannot map a peer's memory
    (``torch.cuda.can_device_access_peer`` is False: no NVLink or PCIe P2P between them; rank r
    runs on GPU r). Anything else that goes wrong setting it up is a failure, not this."""
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce"
    blocked = [
        peer
        for peer in range(world)
        if peer != device.index and not torch.cuda.can_device_access_peer(device, peer)
    ]
    if blocked:
        return f"GPU {device.index} cannot access the memory of GPU {blocked} (no P2P)"
    return None


def make_all_reduce(comm: str, numel: int, device: torch.device):
    """``(buffer_for, all_reduce)`` for sum all-reduces of fp32 exchange buffers of up to ``numel``
    elements: ``buffer_for(shape)`` is a view of one persistent flat buffer, ``all_reduce(buf)``
    returns the reduced buffer.

    ``"nccl"``: ``torch.distributed.all_reduce`` in place (returns ``buf``). ``"symm_mem"``: the
    flat buffer is torch symmetric memory and the op is ``torch.ops.symm_mem.one_shot_all_reduce``
    (P2P loads, no multicast; returns a new tensor). Raises :class:`ArmUnavailable` only where
    :func:`symm_mem_unavailable` says why the op cannot exist here; any other set-up error
    propagates.
    """
    import torch.distributed as dist

    def views(flat):
        def buffer_for(shape):
            count = shape[0] * shape[1]
            if count > numel:
                raise ValueError(f"an exchange of {shape} needs more than {numel} elements")
            return flat[:count].view(shape)

        return buffer_for

    if comm == "nccl":

        def nccl_all_reduce(buf):
            dist.all_reduce(buf)
            return buf

        return views(torch.zeros(numel, dtype=torch.float32, device=device)), nccl_all_reduce
    if comm != "symm_mem":
        raise ValueError(f"comm must be 'nccl' or 'symm_mem', got {comm!r}")
    unavailable = symm_mem_unavailable(device, dist.get_world_size())
    if unavailable is not None:
        raise ArmUnavailable(f"torch symmetric memory one-shot all-reduce: {unavailable}")
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not hasattr(enable, "__deprecated__"):
        enable(group_name)  # needed by a torch that has not deprecated it yet
    flat = symm_mem.empty(numel, dtype=torch.float32, device=device)
    symm_mem.rendezvous(flat, group_name)
    op = torch.ops.symm_mem.one_shot_all_reduce
    flat.zero_()
    op(flat, "sum", group_name)
    torch.cuda.synchronize()

    def symm_all_reduce(buf):
        return op(buf, "sum", group_name)

    return views(flat), symm_all_reduce


# --- the TP benchmarks' helpers ----------------------------------------------------------------------


def tp_size(requested: Optional[int], least: int = 2) -> Optional[int]:
    """The TP size a benchmark runs at: ``requested``, or every visible GPU; None, after saying why
    on stderr, when that is not between ``least`` and the visible GPU count."""
    import sys

    visible = torch.cuda.device_count()
    world = requested or visible
    if not least <= world <= visible:
        print(f"--num-gpu must be between {least} and the {visible} visible GPUs", file=sys.stderr)
        return None
    return world


def interleaved_times_us(graphs: dict, calls: int, replays: int) -> dict:
    """Median microseconds per call of each graph (anything with ``replay()``, holding ``calls``
    calls) over ``replays`` rounds; each round replays every graph once, in turn, so that clock and
    power drift reach all arms alike. Before each timed replay the ranks meet on the GPU (a sleep
    kernel, then a one-element all-reduce on the default group, both outside the timed events), so
    that no rank's time includes waiting for another rank's host to launch."""
    import torch.distributed as dist

    meet = torch.zeros(1, device="cuda")
    times = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(meet)
            times[name].append(replay_us(graph))
    return {name: statistics.median(t) / calls for name, t in times.items()}


def max_over_ranks(value: float) -> float:
    """The maximum of ``value`` over the ranks of the default group."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
