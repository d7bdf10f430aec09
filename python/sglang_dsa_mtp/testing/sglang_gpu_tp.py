"""SGLang's real TP group on GPUs, one all-reduce route at a time, for the argmax exchange's tests.

Each route is a way SGLang 0.5.23 can be configured to all-reduce a TP tensor inside a CUDA-graph
capture, set through SGLang's own switches (:data:`ROUTES`: server args and environment):

* ``custom-ar-v2``: SGLang's defaults on CUDA: the custom all-reduce V2 (a JIT kernel built through
  ``tvm_ffi`` and nvcc from sources inside SGLang's wheel), where the GPUs qualify (all NVLink);
* ``custom-ar-legacy``: ``SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0``, the legacy custom all-reduce
  (``sgl_kernel``'s native kernel);
* ``torch-symm-mem``: ``--disable-custom-all-reduce --enable-torch-symm-mem``;
* ``pynccl``: ``--disable-custom-all-reduce`` (pynccl, enabled inside ``graph_capture()``);
* ``symm-mem-pynccl``: ``--disable-custom-all-reduce --enable-symm-mem``;
* ``gloo``: the CPU form (gloo, no device communicators), for CI.

* :func:`sglang_gpu_tp_group`: in a process started by
  :func:`sglang_dsa_mtp.testing.process_group.run_group`, one per GPU, SGLang's TP group for a route
  (NCCL, SGLang's device communicators), built by ``cpu_tp.sglang_parallel_groups``. SGLang's
  native packages that the harness never calls are stubbed first (:mod:`.sglang_stubs`).
* :class:`AllReduceRecorder`: which of the group's communicators actually ran each all-reduce,
  named as ``integration.tp_all_reduce.all_reduce_route`` names its prediction.
* :func:`capture_replayer`: a body captured in a CUDA graph as SGLang's graph runners do (inside
  SGLang's ``graph_capture()``, two warm-ups with a TP barrier first), replayed on demand; on the CPU
  the body runs eagerly instead, so that the same checks run in CI.
* :func:`exchange_routes_worker`: body of the route test (``rank<r>.json`` reports).

SGLang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.testing.argmax_cases import (
    differences,
    make_overlay,
    padded_shard_width,
    pick_state,
    reference_pick,
)
from sglang_dsa_mtp.testing.sglang_stubs import install_native_stubs


@dataclass(frozen=True)
class Route:
    """One way SGLang can be told to all-reduce: its ServerArgs fields (as the command-line
    ``flags`` set them), environment variables, and native packages it needs."""

    name: str
    flags: str
    server_args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    needs: tuple[str, ...] = ()


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
def sglang_gpu_tp_group(rank: int, world: int, init_method: str, route: Route):
    """SGLang's TP group on GPU ``rank`` for ``route``; yields its ``GroupCoordinator``.

    Call it first in a spawned child. Stubs absent native packages (:mod:`.sglang_stubs`), raises
    :class:`RouteUnavailable` when the route needs one of them, sets the route's environment, then
    builds the group with ``cpu_tp.sglang_parallel_groups(backend="nccl")`` and the route's server
    args: SGLang's own ``GroupCoordinator`` constructor creates pynccl, the custom all-reduce, torch
    symmetric memory (as the switches say and the machine allows)."""
    from sglang_dsa_mtp.testing.cpu_tp import sglang_parallel_groups

    device = select_device()
    if device.type != "cuda":
        raise RuntimeError("sglang_gpu_tp_group needs CUDA GPUs")
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
    """``(group, device)``: :func:`sglang_gpu_tp_group` for a GPU route, the CPU (gloo) group of
    ``cpu_tp.sglang_tp_group`` for :data:`CPU_ROUTE`."""
    if route_name == CPU_ROUTE:
        from sglang_dsa_mtp.testing.cpu_tp import sglang_tp_group

        with sglang_tp_group(rank, world, init_method) as group:
            yield group, torch.device("cpu")
        return
    with sglang_gpu_tp_group(rank, world, init_method, ROUTES[route_name]) as group:
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
    ``(route, capturing)``, the route named as ``all_reduce_route`` names its prediction."""

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


@dataclass(frozen=True)
class Sizes:
    """What :func:`exchange_routes_worker` runs: vocab sizes, hidden size, decode row counts, the
    draft extend's selected rows (of twice as many), replays per graph, logits dtypes."""

    vocabs: tuple[int, ...]
    hidden: int
    decode_rows: tuple[int, ...]
    extend_rows: int
    replays: int
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

    @property
    def max_rows(self) -> int:
        return max(*self.decode_rows, self.extend_rows)

    def forwards(self) -> int:
        """Graphs per engaged route and rank with the exchange on (as many with it off)."""
        return len(self.vocabs) * len(self.dtypes) * (len(self.decode_rows) + 1)


GPU_SIZES = Sizes(
    vocabs=(154880, 129281), hidden=512, decode_rows=(1, 5, 16), extend_rows=8, replays=3
)
CPU_SIZES = Sizes(vocabs=(1001,), hidden=64, decode_rows=(3,), extend_rows=2, replays=2)


def check_all_reduce_route(group, recorder, shape, device, replays: int) -> dict:
    """SGLang's all-reduce of an fp32 ``shape`` buffer: the route predicted at opt-in
    (``all_reduce_route``) against the route taken inside the capture, and each replay's sum
    (rank r contributes ``(r + 1) * (replay + 1)``) against the exact sum."""
    from sglang_dsa_mtp.integration.tp_all_reduce import all_reduce_route

    buffer = torch.zeros(shape, dtype=torch.float32, device=device)
    predicted, on_nccl = all_reduce_route(group, buffer)
    with recorder.recording() as calls:
        replay = capture_replayer(lambda: group.all_reduce(buffer), group, device)
    result = dict(
        shape=list(shape),
        predicted=predicted,
        on_nccl=on_nccl,
        taken=route_taken(calls, group, device),
        sums_exact=True,
    )
    world, rank = group.world_size, group.rank_in_group
    for k in range(replays):
        buffer.fill_(float((rank + 1) * (k + 1)))
        reduced = replay()
        expected = torch.full(shape, float(world * (world + 1) // 2 * (k + 1)), device=device)
        result["sums_exact"] &= bool(torch.equal(reduced, expected))
    return result


class _Overlay:
    """Static ``[rows, shard_width]`` pattern values (in the logits dtype) and a mask, written
    over this rank's LM-head logits: the hard cases of :func:`argmax_cases.make_overlay`."""

    def __init__(self, rows, world, rank, width, vocab, dtype, device):
        self.shape = (rows, world, width, vocab)
        self.shard = slice(rank * width, (rank + 1) * width)
        self.values = torch.zeros(rows, width, dtype=dtype, device=device)
        self.defined = torch.zeros(rows, width, dtype=torch.bool, device=device)

    def fill(self, first_pattern: int) -> list[str]:
        values, defined, names = make_overlay(*self.shape, first_pattern=first_pattern)
        self.values.copy_(values[:, self.shard].to(self.values.dtype))
        self.defined.copy_(defined[:, self.shard])
        return names

    def apply_to(self, processor, stash: dict) -> None:
        """Wrap ``processor._compute_lm_head`` (both SGLang's gather and the plugin's exchange
        call it): the GEMM, then the patterns; the result is kept in ``stash["logits"]``."""
        compute = processor._compute_lm_head

        def compute_with_patterns(hidden_states, *args, **kwargs):
            logits = compute(hidden_states, *args, **kwargs)
            rows = logits.shape[0]
            logits = torch.where(self.defined[:rows], self.values[:rows], logits)
            stash["logits"] = logits
            return logits

        processor._compute_lm_head = compute_with_patterns


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(a.contiguous().view(as_int[a.dtype]), b.contiguous().view(as_int[b.dtype]))
    )


def _shared_hidden(rows: int, hidden: int, seed: int, dtype, device) -> torch.Tensor:
    """The same hidden states on every rank (drawn on the CPU from a shared seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=gen).to(dtype).to(device)


def _forward_cases(sizes: Sizes, device) -> list:
    """``(mode, rows, select_index)``: decode at each row count; the graph draft extend with
    ``extend_rows`` selected (reversed, repeated) rows of twice as many."""
    cases = [("decode", rows, None) for rows in sizes.decode_rows]
    rows = 2 * sizes.extend_rows
    select = torch.arange(rows - 1, -1, -2, dtype=torch.int64)
    select[-1] = select[0]
    cases.append(("draft_extend_v2", rows, select.to(device)))
    return cases


def _check_forwards(group, recorder, device, sizes, vocab, dtype, expect_engaged, seed):
    """One vocab and dtype: the opt-in, then every forward case captured with the exchange on
    (when engaged) and off, each replay's picks against SGLang's pick from the logits that replay
    produced (all-gathered with SGLang's ``GroupCoordinator.all_gather``)."""
    from sglang_dsa_mtp.integration.draft_argmax_exchange import exchange_state
    from sglang_dsa_mtp.testing.cpu_tp import (
        build_lm_head,
        logits_forward,
        logits_processor,
        sglang_pick,
    )

    rank, world = group.rank_in_group, group.world_size
    where = f"vocab {vocab}, {dtype}"
    lm_head, gather_processor, _ = build_lm_head(
        vocab, sizes.hidden, dtype=dtype, seed=seed, device=device
    )
    exchange_processor = logits_processor(vocab)
    engaged = exchange_processor.enable_draft_argmax_exchange(lm_head, max_rows=sizes.max_rows)
    state = exchange_state(exchange_processor)
    result = dict(
        vocab=vocab,
        dtype=str(dtype),
        engaged=engaged,
        route=None if state is None else state.route,
        taken=[],
        checked=0,
        failures=[],
    )
    failures = result["failures"]
    if engaged != expect_engaged:
        failures.append(f"{where}: engaged {engaged}, expected {expect_engaged}")
    width = lm_head.num_embeddings_per_partition
    overlay = _Overlay(sizes.max_rows, world, rank, width, vocab, dtype, device)
    arms = {"gather": gather_processor}
    if engaged:
        arms["exchange"] = exchange_processor
    stashes = {name: {} for name in arms}
    for name, processor in arms.items():
        overlay.apply_to(processor, stashes[name])

    for mode, rows, select in _forward_cases(sizes, device):
        picked = rows if select is None else select.shape[0]
        case = f"{where}, {mode}, {picked} rows"
        hidden = torch.zeros(rows, sizes.hidden, dtype=dtype, device=device)
        states = {name: pick_state(picked, device) for name in arms}
        replays = {}
        for name, processor in arms.items():

            def body(processor=processor, state=states[name]):
                output = logits_forward(processor, lm_head, hidden, mode=mode, select_index=select)
                pick = sglang_pick(output, mode, *state)
                return pick, output.next_token_argmax_partials is not None

            with recorder.recording() as calls:
                replays[name] = capture_replayer(body, group, device)
            if name == "exchange":
                taken = route_taken(calls, group, device)
                result["taken"].append(taken)
                if taken != state.route:
                    failures.append(f"{case}: the exchange ran on {taken}, predicted {state.route}")
        for k in range(sizes.replays):
            names = overlay.fill(first_pattern=k * picked + rows)
            hidden.copy_(
                _shared_hidden(rows, sizes.hidden, seed * 1000 + 31 * k + rows, dtype, device)
            )
            picks, partials = {}, {}
            for name, replay in replays.items():
                fresh = pick_state(picked, device)
                for static, value in zip(states[name], fresh):
                    static.copy_(value)
                picks[name], partials[name] = replay()
            if device.type == "cuda":
                torch.cuda.synchronize()
            gathered = group.all_gather(stashes["gather"]["logits"].contiguous(), dim=-1)
            positions, draft_tokens = pick_state(picked, device)
            if mode == "decode":
                topk_p, topk_index = reference_pick(
                    gathered, vocab, "sanitize", positions, draft_tokens, 1
                )
                want = dict(
                    topk_p=topk_p,
                    topk_index=topk_index,
                    positions=positions,
                    draft_tokens=draft_tokens,
                )
            else:
                want = dict(topk_index=reference_pick(gathered, vocab, "propagate")[1])
            for name in arms:
                differing = differences(picks[name], want)
                if differing:
                    got = picks[name]["topk_index"].view(-1).tolist()
                    failures.append(
                        f"{case}, replay {k}, {name}: {', '.join(differing)} differ from SGLang's "
                        f"pick of the gathered logits (ours {got}, "
                        f"SGLang's {want['topk_index'].view(-1).tolist()}; rows {names[:picked]})"
                    )
            if partials["gather"]:
                failures.append(f"{case}: the gather processor returned partials")
            if engaged:
                if not partials["exchange"]:
                    failures.append(f"{case}: the engaged processor returned no partials")
                if not _same_bits(stashes["exchange"]["logits"], stashes["gather"]["logits"]):
                    failures.append(f"{case}, replay {k}: the two graphs' LM-head logits differ")
            result["checked"] += 1
    return result


def exchange_routes_worker(
    rank: int, world: int, init_method: str, result_dir: str, route_name: str
) -> None:
    """Body of the route test of the draft argmax exchange, one process per rank; writes
    ``rank<r>.json``.

    In SGLang's TP group for ``route_name`` (:func:`route_group`), with the plugin registered and its
    hooks applied by SGLang's ``HookRegistry``, and :class:`AllReduceRecorder` on the group:

    * the device communicators SGLang built, and whether the route is offered here;
    * for each vocab, the fp32 exchange buffer's all-reduce at 1 and the most rows: the route
      predicted at opt-in (``all_reduce_route``) equals the route taken inside the CUDA-graph capture
      (:func:`check_all_reduce_route`), and every replay's sum is exact;
    * for each vocab and dtype, ``enable_draft_argmax_exchange`` engages exactly when that route is
      not NCCL, and names the predicted route; then SGLang's draft ``LogitsProcessor`` forward and
      the greedy pick (decode: ``draft_topk1_postprocess``, hooked; graph draft extend: the
      ``propagate`` finalize or ``torch.argmax``) are captured with the exchange on (when engaged)
      and off, and replayed with new hidden states and new :data:`argmax_cases.PATTERNS` rows
      (ties, NaN, inf, signed zeros over the LM-head logits): tokens, ``topk_p``, positions and
      draft tokens of both equal SGLang's pick from the all-gathered logits of that replay, bit for
      bit, and the exchange ran on the predicted route inside the capture.

    On the CPU (``route_name == "gloo"``) the same runs eagerly, at :data:`CPU_SIZES`. With one
    rank (one GPU) the processor gathers nothing and keeps SGLang's path; the group, the captures
    and the picks are still checked.
    """
    start = time.monotonic()
    sizes = CPU_SIZES if route_name == CPU_ROUTE else GPU_SIZES
    report = dict(rank=rank, world=world, route=route_name, failures=[], all_reduce=[], forwards=[])
    failures = report["failures"]
    try:
        with route_group(rank, world, init_method, route_name) as (group, device):
            from sglang.srt.plugins.hook_registry import HookRegistry

            from sglang_dsa_mtp import plugin
            from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape

            plugin.register()
            HookRegistry.apply_hooks()
            status = plugin.feature_status()["draft_argmax_exchange"]
            report["feature"] = [status.enabled, status.reason]
            report["communicators"] = describe_communicators(group)
            report["not_offered"] = route_offered(route_name, report["communicators"])
            report["setup_s"] = round(time.monotonic() - start, 2)
            if not status.enabled:
                failures.append(f"the draft argmax exchange is off: {status.reason}")
                return
            with AllReduceRecorder(group) as recorder:
                for i, vocab in enumerate(sizes.vocabs):
                    width = padded_shard_width(vocab, world)
                    checks = [
                        check_all_reduce_route(
                            group,
                            recorder,
                            exchange_shape(rows, width, world),
                            device,
                            sizes.replays,
                        )
                        for rows in sorted({1, sizes.max_rows})
                    ]
                    report["all_reduce"] += checks
                    for check in checks:
                        if check["predicted"] != check["taken"]:
                            failures.append(
                                f"vocab {vocab}, {check['shape']}: all-reduce predicted "
                                f"{check['predicted']}, taken {check['taken']}"
                            )
                        if not check["sums_exact"]:
                            failures.append(f"vocab {vocab}, {check['shape']}: inexact sum")
                    # One rank gathers nothing: the exchange needs a TP group.
                    expect_engaged = world > 1 and not any(c["on_nccl"] for c in checks)
                    for j, dtype in enumerate(sizes.dtypes):
                        result = _check_forwards(
                            group, recorder, device, sizes, vocab, dtype, expect_engaged, 10 * i + j
                        )
                        failures += result.pop("failures")
                        report["forwards"].append(result)
    except RouteUnavailable as exc:
        report["skipped"] = str(exc)
    finally:
        report["seconds"] = round(time.monotonic() - start, 2)
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if failures:
        raise AssertionError(f"rank {rank}, route {route_name}: " + "\n".join(failures[:20]))
