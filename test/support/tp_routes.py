"""The argmax exchanges in SGLang's own TP group, one all-reduce route at a time: what the route
tests (``test/registered/unit/spec/test_*_argmax_exchange_sglang_tp.py``) and the route benchmarks
(``test/registered/kernels/benchmark/speculative/bench_*_argmax_exchange_sglang.py``) share, so
that each keeps only its own exchange's checks or arms.

* Each rank: :func:`plugin_route_group`, SGLang's TP group for one route (``tp.route_group``) with
  the plugin registered and its hooks applied by SGLang's ``HookRegistry``.
* The route tests: :data:`ENGAGES` (the routes on which an exchange must engage);
  :func:`run_route_checks`, one rank's body around the exchange's own checks (the feature's status,
  the communicators SGLang built, whether the route is offered, an ``AllReduceRecorder`` on the
  group, ``rank<r>.json``); :func:`capture_on_route`, a capture and the route its all-reduces took,
  and :func:`record_route_taken`; :class:`ShardOverlay`, the hard rows of
  ``argmax_cases.make_overlay`` over this rank's LM-head logits; and in the test,
  :func:`check_route_reports`, the verdict on the ranks' reports.
* The route benchmarks: :func:`route_parser` and :func:`parse_route_args` (the options both take,
  around the benchmark's own, with :func:`add_num_gpu`); :func:`run_route_bench`, one rank's
  body around the exchange's own measurements (rank 0 writes them); :class:`LmHeadArms`, the arms
  both exchanges time beside their own; :func:`floors`; :func:`time_arms`; :func:`bench_main`,
  every route in turn, the title and ``--json``; and the tables' :data:`ARMS`, :func:`print_route_head`, :func:`print_table`,
  :func:`cell` and :func:`change_cell`.

SGLang and pytest are imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from support.argmax_cases import HIDDEN, VOCAB, make_overlay, padded_shard_width
from support.bench_cli import (
    benchmark_parser,
    markdown_header,
    markdown_row,
    parse_list,
    write_json,
)
from support.tp import (
    CPU_ROUTE,
    GPU_ROUTES,
    ROUTES,
    AllReduceRecorder,
    RouteUnavailable,
    capture_replayer,
    describe_communicators,
    interleaved_times_us,
    max_over_ranks,
    route_group,
    route_offered,
    route_taken,
    run_group,
    shared_hidden,
    tp_size,
)

# --- each rank: SGLang's group for one route, the plugin's hooks applied --------------------------


@contextlib.contextmanager
def plugin_route_group(rank: int, world: int, init_method: str, route_name: str):
    """``(group, device)`` of ``tp.route_group`` for ``route_name``, the plugin registered and its
    hooks applied by SGLang's ``HookRegistry``."""
    with route_group(rank, world, init_method, route_name) as (group, device):
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_dsa_mtp import plugin

        plugin.register()
        HookRegistry.apply_hooks()
        yield group, device


# --- the route tests ------------------------------------------------------------------------------

# Where an exchange must engage at TP > 1: on a route that is not NCCL inside the capture.
ENGAGES = {
    "custom-ar-v2": True,
    "custom-ar-legacy": True,
    "torch-symm-mem": False,  # SGLang's torch symmetric memory all-reduce takes bf16 only
    "pynccl": False,
    "symm-mem-pynccl": False,
    CPU_ROUTE: True,
}


def run_route_checks(
    rank: int,
    world: int,
    init_method: str,
    result_dir: str,
    route_name: str,
    feature: str,
    checks: Callable,
) -> None:
    """One rank of a route test: writes ``rank<r>.json``, then raises with the failures, if any.

    In :func:`plugin_route_group` for ``route_name``, the report records the plugin's ``feature``
    status, the device communicators SGLang built, and whether the route is offered here
    (``tp.route_offered``: None, or why not); with the feature on, ``checks(group, device, recorder,
    report)`` runs under an ``AllReduceRecorder`` of the group, appending what it finds wrong to
    ``report["failures"]`` and each forward's result to ``report["forwards"]``. A route that cannot
    be built here as users deploy it is reported as ``skipped``; the feature off, as a failure."""
    start = time.monotonic()
    report = dict(rank=rank, world=world, route=route_name, failures=[], forwards=[])
    failures = report["failures"]
    try:
        with plugin_route_group(rank, world, init_method, route_name) as (group, device):
            from sglang_dsa_mtp import plugin

            status = plugin.feature_status()[feature]
            report["feature"] = [status.enabled, status.reason]
            report["communicators"] = describe_communicators(group)
            report["not_offered"] = route_offered(route_name, report["communicators"])
            report["setup_s"] = round(time.monotonic() - start, 2)
            if not status.enabled:
                failures.append(f"the {feature.replace('_', ' ')} is off: {status.reason}")
                return
            with AllReduceRecorder(group) as recorder:
                checks(group, device, recorder, report)
    except RouteUnavailable as exc:
        report["skipped"] = str(exc)
    finally:
        report["seconds"] = round(time.monotonic() - start, 2)
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if failures:
        raise AssertionError(f"rank {rank}, route {route_name}: " + "\n".join(failures[:20]))


def capture_on_route(body: Callable[[], object], group, device: torch.device, recorder):
    """``(replay, taken)``: ``tp.capture_replayer`` of ``body``, and the route its all-reduces took
    inside the capture, as ``recorder`` (the group's ``AllReduceRecorder``) saw them."""
    with recorder.recording() as calls:
        replay = capture_replayer(body, group, device)
    return replay, route_taken(calls, group, device)


def record_route_taken(result: dict, taken: str, predicted: str, case: str) -> None:
    """Appends the route an exchange's capture took to ``result["taken"]``, and a failure to
    ``result["failures"]`` where it is not the route predicted at opt-in."""
    result["taken"].append(taken)
    if taken != predicted:
        result["failures"].append(f"{case}: the exchange ran on {taken}, predicted {predicted}")


class ShardOverlay:
    """Static ``[rows, shard_width]`` pattern values (in the logits dtype) and a mask, written over
    this rank's LM-head logits: the hard cases of ``argmax_cases.make_overlay``."""

    def __init__(self, rows, world, rank, width, vocab, dtype, device):
        self.shape = (rows, world, width, vocab)
        self.shard = slice(rank * width, (rank + 1) * width)
        self.values = torch.zeros(rows, width, dtype=dtype, device=device)
        self.defined = torch.zeros(rows, width, dtype=torch.bool, device=device)

    def fill(self, first_pattern: int) -> list[str]:
        """New rows, from pattern ``first_pattern`` on; returns each row's pattern name."""
        values, defined, names = make_overlay(*self.shape, first_pattern=first_pattern)
        self.values.copy_(values[:, self.shard].to(self.values.dtype))
        self.defined.copy_(defined[:, self.shard])
        return names

    def apply_to(self, processor) -> dict:
        """Wrap ``processor._compute_lm_head`` (both SGLang's gather and the plugin's exchange
        call it): the GEMM, then the patterns. Returns the dict whose ``"logits"`` is the last
        result."""
        compute = processor._compute_lm_head
        stash = {}

        def compute_with_patterns(hidden_states, *args, **kwargs):
            logits = compute(hidden_states, *args, **kwargs)
            rows = logits.shape[0]
            logits = torch.where(self.defined[:rows], self.values[:rows], logits)
            stash["logits"] = logits
            return logits

        processor._compute_lm_head = compute_with_patterns
        return stash


def check_route_reports(
    reports: list[dict], world: int, route: str, check_rank: Callable[[dict, str], None]
) -> list[dict]:
    """A route test's verdict on its ranks' reports, which it returns: one from every rank;
    skipped, with the reasons, where a rank could not build the route; on every rank no failures
    and the feature on, then ``check_rank(report, where)``; skipped last, after every check passed,
    where SGLang did not offer the route on this machine (at TP > 1: one rank all-reduces
    nothing)."""
    import pytest

    assert [r["rank"] for r in reports] == list(range(world)), reports
    skipped = sorted({r["skipped"] for r in reports if r.get("skipped")})
    if skipped:
        pytest.skip("; ".join(skipped))
    for report in reports:
        where = f"rank {report['rank']}, route {route}"
        assert report["failures"] == [], where
        assert report["feature"][0], f"{where}: {report['feature'][1]}"
        check_rank(report, where)
    not_offered = sorted({r["not_offered"] for r in reports if r["not_offered"]})
    if not_offered and world > 1:
        pytest.skip(f"route {route} not offered here ({'; '.join(not_offered)}); checks passed")
    return reports


# --- the route benchmarks -------------------------------------------------------------------------

# Every arm of a route table, in its order: LmHeadArms' and the two paths'.
ARMS = ("GEMM", "gather", "all-reduce", "GEMM + all-reduce", "exchange")


def add_num_gpu(parser, *, one_gpu: str) -> None:
    """``--num-gpu``, the TP size; ``one_gpu`` says what 1 does."""
    parser.add_argument(
        "--num-gpu",
        type=int,
        default=None,
        help="TP size, one process per GPU (default: every visible GPU); " + one_gpu,
    )


def route_parser(doc: str, add_options: Callable, *, per_graph: str, dry_run: dict):
    """A route benchmark's parser (``bench_cli.benchmark_parser`` of ``doc``): ``--routes`` (of
    ``tp.ROUTES``, one table each), the benchmark's own options (``add_options(parser)``:
    :func:`add_num_gpu` and its sizes), the LM head's sizes, ``--calls`` (``per_graph``: what one
    call is) per graph, ``--replays``, ``--json``, and ``--dry-run`` at the sizes of ``dry_run``."""
    parser = benchmark_parser(doc)
    parser.add_argument(
        "--routes",
        default=",".join(GPU_ROUTES),
        help="all-reduce routes (support.tp.ROUTES), comma-separated; one table each",
    )
    add_options(parser)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size")
    parser.add_argument(
        "--calls",
        type=int,
        default=10,
        help=f"{per_graph} captured back to back in one CUDA graph",
    )
    parser.add_argument(
        "--replays", type=int, default=30, help="timed rounds; each figure is their median"
    )
    parser.add_argument("--json", help="write every measurement to this file")
    sizes = ", ".join(f"{name} {value}" for name, value in dry_run.items())
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"run the arms once, eagerly and untimed, in a 2-process CPU (gloo) group at {sizes}",
    )
    return parser


def parse_route_args(parser, argv, *, dry_run: dict):
    """A route benchmark's options, parsed from ``argv`` by its :func:`route_parser`: the
    list-valued sizes of ``dry_run`` are comma-separated options, ``--routes`` is checked; a dry
    run takes the sizes of ``dry_run``, one call a graph, on the CPU's route."""
    args = parser.parse_args(argv)
    for name, value in dry_run.items():
        if isinstance(value, list):
            setattr(args, name, parse_list(getattr(args, name)))
    args.routes = args.routes.split(",")
    unknown = set(args.routes) - set(ROUTES)
    if unknown:
        raise SystemExit(f"--routes takes any of {list(ROUTES)}, got {sorted(unknown)}")
    if args.dry_run:
        for name, value in dry_run.items():
            setattr(args, name, value)
        args.calls = 1
        args.routes = [CPU_ROUTE]
    return args


def run_route_bench(
    rank: int,
    world: int,
    init_method: str,
    route: str,
    result_file: str,
    measure: Callable,
) -> None:
    """One rank of a route benchmark: in :func:`plugin_route_group` for ``route``, the
    communicators SGLang built, then ``measure(group, device, report)`` (its figures the maximum
    over ranks, into ``report["results"]``); rank 0 writes the report as JSON. A route that cannot
    be built here is reported as ``unavailable``."""
    report = dict(route=route, results={})
    try:
        with plugin_route_group(rank, world, init_method, route) as (group, device):
            report["communicators"] = describe_communicators(group)
            measure(group, device, report)
    except RouteUnavailable as exc:
        report["unavailable"] = str(exc)
    except Exception:
        traceback.print_exc()
        raise
    if rank == 0:
        Path(result_file).write_text(json.dumps(report))


class LmHeadArms:
    """One rank's arms at ``rows`` rows through SGLang's processors ``gather`` (SGLang's path) and
    ``exchange`` (opted in) of ``lm_head``, that each exchange times beside its own: the GEMM, the
    fp32 exchange buffer's all-reduce, and both. ``hidden``: the same random rows on every rank."""

    def __init__(self, group, device, lm_head, gather, exchange, rows, hidden):
        from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape

        self.group, self.lm_head = group, lm_head
        self.processors = dict(gather=gather, exchange=exchange)
        self.hidden = shared_hidden(
            rows, hidden, seed=rows, dtype=lm_head.weight.dtype, device=device
        )
        shape = exchange_shape(rows, lm_head.num_embeddings_per_partition, group.world_size)
        self.buffer = torch.zeros(shape, dtype=torch.float32, device=device)

    def gemm(self):
        return self.processors["gather"]._compute_lm_head(self.hidden, self.lm_head, None)

    def all_reduce(self):
        return self.group.all_reduce(self.buffer)

    def gemm_and_all_reduce(self):
        self.gemm()
        return self.all_reduce()


def floors(lm_head, device: torch.device) -> dict:
    """On CUDA, the floors printed in a route's header: ``launch_floor_us`` (a one-element kernel
    per call in a graph) and ``gemm_floor_us`` (the weight shard's bytes over the copy bandwidth);
    on the CPU none."""
    if device.type != "cuda":
        return {}
    from support.timing import copy_bandwidth_bytes_per_us, launch_floor_us

    weight_bytes = lm_head.weight.numel() * lm_head.weight.element_size()
    return dict(
        launch_floor_us=launch_floor_us(),
        gemm_floor_us=weight_bytes / copy_bandwidth_bytes_per_us(),
    )


def time_arms(bodies: dict, group, device: torch.device, calls: int, replays: int) -> dict:
    """Each arm's microseconds per call, the maximum over ranks: every body captured ``calls``
    times in one graph (``tp.capture_replayer``), the graphs replayed in turn ``replays`` times
    (``tp.interleaved_times_us``). On the CPU each body runs once and every figure is None."""
    graphs = {
        name: SimpleNamespace(
            replay=capture_replayer(lambda body=body: [body() for _ in range(calls)], group, device)
        )
        for name, body in bodies.items()
    }
    if device.type != "cuda":
        return {name: None for name in graphs}
    times = interleaved_times_us(graphs, calls, replays)
    return {name: max_over_ranks(t) for name, t in times.items()}


def bench_main(
    args,
    bench_route: Callable,
    print_route: Callable,
    *,
    step: str,
    per_graph: str,
    sizes: str = "",
) -> int:
    """A route benchmark's run, with ``args`` from :func:`parse_route_args`: returns its exit
    status.

    ``bench_route(rank, world, init_method, args, route, result_file)`` (a module-level function)
    is spawned on every rank (two CPU ranks for a dry run) for each of ``args.routes`` in turn;
    then the title (``step`` through SGLang's TP group, the LM head's sizes and ``sizes``, what the
    figures are: ``per_graph`` names what one call is), ``print_route(world, report)`` of each
    route, and with ``--json`` every measurement. Without the GPUs it needs, 2, after saying why on
    stderr."""
    if args.dry_run:
        world = 2
    else:
        if not torch.cuda.is_available():
            print("this benchmark needs CUDA GPUs (or --dry-run)", file=sys.stderr)
            return 2
        world = tp_size(args.num_gpu, least=1)
        if world is None:
            return 2
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for route in args.routes:
            result_file = str(Path(tmp, f"{route}.json"))
            run_group(bench_route, world, args, route, result_file, timeout_s=1800)
            reports.append(json.loads(Path(result_file).read_text()))
    timing = (
        "dry run"
        if args.dry_run
        else f"{args.calls} {per_graph} per graph, median of {args.replays} replays, max over "
        "ranks; us"
    )
    print(
        f"# {step} through SGLang's TP group: vocab {args.vocab} "
        f"(shard {padded_shard_width(args.vocab, world)}), hidden {args.hidden}, bf16 LM head"
        f"{sizes}; {timing}\n"
    )
    for report in reports:
        print_route(world, report)
    if args.json:
        write_json(args.json, {"tp": world, "args": vars(args), "routes": reports})
    return 0


def print_route_head(world: int, report: dict, *, kept: str) -> bool:
    """A route's heading and header lines: the communicators SGLang built, the route predicted for
    the exchange buffer, whether the exchange engages (else ``kept``, what the plugin keeps), the
    floors or the dry run's note. False, after one line saying why, where the route did not run."""
    route = report["route"]
    flags = ROUTES[route].flags if route in ROUTES else "CPU, gloo"
    if "unavailable" in report:
        print(f"## {route} ({flags}): not run, {report['unavailable']}\n")
        return False
    built = ", ".join(f"{k} {v}" for k, v in report["communicators"].items() if v)
    engaged = "the exchange engages" if report["engaged"] else kept
    print(f"## {route} ({flags})\n")
    print(f"TP{world}; SGLang built: {built or 'no device communicator'}")
    print(f"the exchange buffer's all-reduce in a graph: {report['predicted']}; {engaged}")
    if "launch_floor_us" in report:
        print(
            f"floors: launch {report['launch_floor_us']:.1f} us per call; GEMM (weight shard bytes "
            f"/ copy bandwidth) {report['gemm_floor_us']:.1f} us"
        )
    else:
        print(
            "dry run: each arm ran once, eagerly, untimed; where engaged, the exchange picked the "
            "gather's tokens"
        )
    print()
    return True


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A route's table, markdown, and a blank line after it."""
    print(markdown_header(header))
    for cells in rows:
        print(markdown_row(cells))
    print()


def cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def change_cell(gather, exchange) -> str:
    """``gather → exchange`` in microseconds, ``-`` where either did not run or was not timed."""
    return "-" if exchange is None or gather is None else f"{gather:.1f} → {exchange:.1f}"
