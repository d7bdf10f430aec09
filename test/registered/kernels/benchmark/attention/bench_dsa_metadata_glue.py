"""The metadata glue on SGLang's DSA backends under CUDA graphs: each runner's whole replay prep, host
and device time, for SGLang's eager prep, the plugin's eager prep and the plugin's glued prep, beside
one graph replay; what the glue graphs keep after capture; what each key's capture costs.

Reproduces the tables "Metadata glue" of docs/results.md on the GPU at hand. Everything runs SGLang
0.5.23's own classes (``support.dsa_serving``: the target verify through SGLang's
``DecodeCudaGraphRunner`` replay prep, the draft extend and the MTP draft decode as their runners
hand the prep; the stand-ins it names for DeepGEMM's schedule, SGLang's JIT top-k plan and FlashMLA's
metadata, which a CUDA machine without SGLang's native packages lacks: torch functions, a few
launches each, where the real ones are one launch each; with --real-leaves, SGLang's own JIT
schedule, top-k plan and metadata copies and FlashMLA's metadata where they run). Three arms of one server (--launch, seeded
draft steps, --max-bs, a 1M context): ``stock`` (every kill switch off), ``eager``
(``SGLANG_DSA_METADATA_GLUE=0``), ``glued`` (the plugin's defaults); and, for the target verify
alone, SGLang's own glue route as a reference (``sglang glue``: every kill switch off,
``SGLANG_ENABLE_METADATA_GLUE_GRAPH=1`` and ``SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW=1``): the least host
time a replay prep through ``MetadataGlueGraph`` has in SGLang, no line of the plugin's in it
(SGLang glues only unpadded replays: a padded one is its eager prep through the replay view).

* Host time: per op and live batch size (--bs; a live size below its captured bs replays padded),
  every request at --live tokens; one untimed call, then --calls turns, each timing in turn every
  arm's prep call, one ``CUDAGraph.replay()`` of a one-kernel graph (the floor) and the glued arm's
  glue graph replayed alone (with the stand-ins' launches in it: a real server's graph holds one
  launch where a stand-in makes several), the queue drained before each; medians. The prep call
  is the runner's alone (what ``load_batch`` builds before it, the key included, is not timed).
  SGLang's glue route: its two eager warm-ups and its capture untimed, then timed in the same turns.
  Then warm: the glued arm's replays (input copies, prep, model graph) --calls times back to back,
  then SGLang's glue route's, then each graph's replays likewise, then each graph replayed in the
  prep's place (the glued arm's replays, the graph timed where the prep runs: after the same input
  copies), the same medians. Then the Python around the glue graph, in the prep's place likewise:
  the glued prep with its glue graph's launch a no-op, the glue's own replay of the key so, and a
  no-op call (the timer's floor). Per EAGLE round: the three ops' sum.
* Device time: the same calls between two CUDA events (the queue drained first): for the eager
  arms the span of the prep's launches, for the glued arm the graph's.
* Memory: per --memory-max-bs, the eager and glued arms each built alone: ``memory_allocated`` and
  ``memory_reserved`` after every batch size's capture, beyond what they were before the arm was
  built, and the bytes and number of the CUDA caching allocator's pools that are neither the
  default pool nor the arm's model-graph pool (the glue graphs': the one they share). Measured
  first, max bs in the order given, so that the shared pool holds nothing from an earlier arm
  but what a smaller max bs left there.
* Capture: the time each key's glue capture took at the server's capture (its two eager warm-ups
  and its capture, the queue drained), per runner: median and total.

    python test/registered/kernels/benchmark/attention/bench_dsa_metadata_glue.py --json glue.json
    python test/registered/kernels/benchmark/attention/bench_dsa_metadata_glue.py --dry-run  # CPU
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import contextlib
import functools
import statistics
import time

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before any kernel module is imported (sets TRITON_INTERPRET on a CPU)

import torch  # noqa: E402

from support.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    write_json,
)
from support import real_ops  # noqa: E402
from support.dsa_backends import LAUNCHES  # noqa: E402

ARMS = ("stock", "eager", "glued")
SGLANG_GLUE = "sglang glue"  # SGLang's own glue route, the target verify's reference
SGLANG_GLUE_ENV = {
    "SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1",
    "SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW": "1",
}
MB = 1e6
DRY_RUN = dict(max_bs=2, bs=[1, 2], memory_max_bs=[2], calls=1)


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--launch", default="4/1/5", choices=sorted(LAUNCHES), help="EAGLE launch")
    parser.add_argument("--max-bs", type=int, default=48, help="--cuda-graph-max-bs-decode")
    parser.add_argument(
        "--bs", nargs="+", type=int, default=[1, 4, 9, 16, 33, 48], help="live batch sizes"
    )
    parser.add_argument("--live", type=int, default=1024, help="tokens of every request")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per op, bs, arm")
    parser.add_argument(
        "--memory-max-bs", nargs="+", type=int, default=[48, 256], help="max bs of the memory"
    )
    parser.add_argument(
        "--real-leaves",
        action="store_true",
        help="SGLang's own leaves of the prep where they run (its JIT schedule, top-k plan and "
        "metadata copies, FlashMLA's metadata: support.real_ops), stand-ins for the rest",
    )
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"on the CPU through Triton's interpreter (graphs simulated), no figures: {DRY_RUN}",
    )
    return parser


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def cell(value, fmt="{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def arm_env(label: str) -> dict:
    from support import dsa_serving

    return {
        "stock": dsa_serving.OFF,
        "eager": {**dsa_serving.ON, dsa_serving.GLUE_ENV: "0"},
        "glued": dsa_serving.ON,
        SGLANG_GLUE: {**dsa_serving.OFF, **SGLANG_GLUE_ENV},
    }[label]


def build_arm(label: str, name: str, sizes, captured, req_to_token, *, reader=True):
    from support import dsa_serving

    stock = label in ("stock", SGLANG_GLUE)
    kernels = dsa_serving.sglang_metadata_kernels(sizes.device) if stock else None
    arm = dsa_serving.Arm(
        label,
        arm_env(label),
        sizes=sizes,
        tokens=LAUNCHES[name][2],
        req_to_token=req_to_token,
        seeded=True,
        kernels=kernels,
        reader=reader,
    )
    arm.capture(captured)
    return arm


def new_req_to_token(sizes, tokens: int) -> torch.Tensor:
    table = torch.zeros(
        sizes.pool, sizes.context + 4 + tokens, dtype=torch.int32, device=sizes.device
    )
    table[1:].random_(0, 1 << 30)
    return table


def one_kernel_graph():
    """A CUDA graph of one kernel: what one graph replay costs the host at the least."""
    x = torch.zeros(1, device=DEVICE)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x.add_(1)
    graph.x = x  # the graph's buffer lives as long as the graph
    return graph


def glue_graph(arms: dict, op: str, bs: int):
    """The glued arm's glue graph of (``op``, ``bs``), or None (not on a GPU, not captured)."""
    if DEVICE.type != "cuda" or "glued" not in arms:
        return None
    from support import serving_loop

    arm = arms["glued"]
    glue = serving_loop.arm_glues(arm)[op][0]
    key = serving_loop.glue_key_of(arm.runners[op], bs)
    state = None if glue is None else glue._states.get(key)  # SGLang's per-key record
    return None if state is None else state["graph"]


def sglang_glue_route(arm, raw: int, bs: int, tokens: int):
    """(a call of the target verify's replay prep on ``arm``'s decode runner, whose own glue route
    SGLang's switches turned on, the key it glues the replay under)."""
    from support import dsa_serving

    runner = arm.runners["target verify"].decode_runner
    batch, kwargs = dsa_serving.replay_prep_arguments(
        runner, raw_bs=raw, bs=bs, num_tokens=bs * tokens
    )

    def call() -> None:
        runner._init_replay_attn_metadata(batch, **kwargs)

    return call, kwargs["glue_key"]


def noop() -> None:
    pass


@contextlib.contextmanager
def glue_launch_noop(arm, op: str, bs: int):
    """The glue of (``op``, ``bs``) on the glued ``arm`` with its graph's launch a no-op (its
    metadata stores kept) while the block runs; yields a call of the glue's replay of that key, or
    None where the glue holds no such key."""
    from support import serving_loop

    glue = serving_loop.arm_glues(arm)[op][0]
    key = serving_loop.glue_key_of(arm.runners[op], bs)
    ready = getattr(glue, "_ready", {})  # the plugin's GlueGraph: key -> (launch, stores)
    if key not in ready:
        yield None
        return
    launch, stores = ready[key]
    ready[key] = (noop, stores)
    try:
        yield lambda: glue.replay(key)
    finally:
        ready[key] = (launch, stores)


@contextlib.contextmanager
def least_glued(arm, op: str, raw: int, bs: int, tokens: int, launch):
    """Yields a call, for the prep's place, of SGLang's lines up to the plugin's code, the plugin's
    part the least a glued replay can be: ``launch()``. The target verify: SGLang's
    ``_init_replay_attn_metadata`` (unpadded: its glue route, to a ``MetadataGlueGraph`` whose key
    is captured and whose replay is the launch; padded: to the replay view through
    ``HookRegistry``'s AROUND wrapper of a hook that is the launch); the draft runners: that
    wrapper of such a hook, called as the runner calls the prep."""
    from types import MethodType

    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from support import dsa_serving

    runner = arm.runners[op].decode_runner
    if runner is None:
        backend = arm.runners[op].backend

        def hook(original, self, forward_batch, in_capture=False):
            launch()

        prep = type(backend).init_forward_metadata_out_graph.__wrapped__
        yield functools.partial(MethodType(_wrap_fn(prep, hook, HookType.AROUND), backend), None)
        return
    batch, kwargs = dsa_serving.replay_prep_arguments(
        runner, raw_bs=raw, bs=bs, num_tokens=bs * tokens
    )

    class LeastGlue(MetadataGlueGraph):
        def replay(self, key):
            launch()

    glue = LeastGlue(DEVICE)
    glue.is_captured = {kwargs["glue_key"]}.__contains__

    def view_hook(
        original, self, forward_batch, *, raw_bs, bs, num_tokens, glue_key, attention_variant
    ):  # the plugin's hook's signature
        launch()

    view = type(runner)._init_replay_attn_metadata_from_view.__wrapped__
    kept = runner._metadata_glue
    runner._metadata_glue = glue
    runner._init_replay_attn_metadata_from_view = MethodType(
        _wrap_fn(view, view_hook, HookType.AROUND), runner
    )
    try:
        yield lambda: runner._init_replay_attn_metadata(batch, **kwargs)
    finally:
        runner._metadata_glue = kept
        del runner._init_replay_attn_metadata_from_view


def timed_replay(graph) -> float:
    start = time.perf_counter()
    graph.replay()
    return (time.perf_counter() - start) * 1e6


def measure_prep(arms: dict, reference, captured, tokens: int, batch_sizes, calls: int, live: int):
    """Per op and live bs: each arm's median host and device microseconds of the runner's prep,
    and in the same turns the host time of one replay of a one-kernel graph and of the glue
    graph alone; for the target verify, SGLang's own glue route on ``reference`` (the
    ``sglang glue`` arm) too."""
    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

    from support import dsa_serving

    rows = []
    context = next(iter(arms.values())).sizes.context
    floor = one_kernel_graph() if DEVICE.type == "cuda" else None
    for op in dsa_serving.OPS:
        for raw in batch_sizes:
            bs = min(b for b in captured if b >= raw)
            lengths = [min(live, context)] * raw
            if op == "draft extend":
                lengths = [n + tokens for n in lengths]
            seq_lens = dsa_serving.request_tensor(lengths, DEVICE)
            slots = dsa_serving.request_tensor(range(1, raw + 1), DEVICE)
            extra = None
            if op == "draft extend":  # the round's accept lengths
                extra = torch.ones(raw, dtype=torch.int32, device=DEVICE)
            for arm in arms.values():  # untimed; a decode runner decides its glue at its first
                arm.replay(op, bs, seq_lens, slots, extra)
            route = route_key = None
            if op == "target verify":  # its warm-ups and capture, untimed
                route, route_key = sglang_glue_route(reference, raw, bs, tokens)
                for _ in range(MetadataGlueGraph.NUM_WARMUP + 1):
                    reference.replay(op, bs, seq_lens, slots, extra, in_place=route)
            graphs = {"graph": floor, "glue graph": glue_graph(arms, op, bs)}
            graphs = {label: graph for label, graph in graphs.items() if graph is not None}
            labels = (*arms, *graphs, "glued warm", *(f"{label} warm" for label in graphs))
            labels += tuple(f"{label} in place" for label in graphs)
            labels += (SGLANG_GLUE, f"{SGLANG_GLUE} warm")
            host = {label: [] for label in labels}
            device = {label: [] for label in arms}
            for _ in range(calls):
                for label, arm in arms.items():
                    sync()
                    if DEVICE.type == "cuda":
                        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                        start.record()
                    host[label].append(arm.replay(op, bs, seq_lens, slots, extra))
                    if DEVICE.type == "cuda":
                        end.record()
                        end.synchronize()
                        device[label].append(start.elapsed_time(end) * 1e3)
                if route is not None:
                    sync()
                    host[SGLANG_GLUE].append(
                        reference.replay(op, bs, seq_lens, slots, extra, in_place=route)
                    )
                for label, graph in graphs.items():
                    sync()
                    host[label].append(timed_replay(graph))
            # Then each alone, its calls back to back (warm): the glued arm's replays (the
            # runner's input copies, the prep, the model graph), and each graph's replays.
            if "glued" in arms:
                for _ in range(calls):
                    sync()
                    host["glued warm"].append(arms["glued"].replay(op, bs, seq_lens, slots, extra))
            if route is not None:
                for _ in range(calls):
                    sync()
                    host[f"{SGLANG_GLUE} warm"].append(
                        reference.replay(op, bs, seq_lens, slots, extra, in_place=route)
                    )
            for label, graph in graphs.items():
                for _ in range(calls):
                    sync()
                    host[f"{label} warm"].append(timed_replay(graph))
            # Each graph's replay in the prep's place: the glued arm's replays, its input copies
            # made, the graph replayed where the prep would run (timed), then the model graph.
            if "glued" in arms:
                glued = arms["glued"]
                for label, graph in graphs.items():
                    for _ in range(calls):
                        sync()
                        host[f"{label} in place"].append(
                            glued.replay(op, bs, seq_lens, slots, extra, in_place=graph.replay)
                        )
            # The Python around the glue graph: the glued arm's prep with that graph's launch a
            # no-op, the glue's replay of the key alone so, and a no-op, each in the prep's place.
            if "glued" in arms:
                glued = arms["glued"]
                with glue_launch_noop(glued, op, bs) as glue_replay:
                    if glue_replay is not None:
                        timed = (("python glued", None), ("python glue replay", glue_replay))
                        for label, call in (*timed, ("noop", noop)):
                            for _ in range(calls):
                                sync()
                                host.setdefault(f"{label} in place", []).append(
                                    glued.replay(op, bs, seq_lens, slots, extra, in_place=call)
                                )
                # The least glued: SGLang's lines, the plugin's part one graph launch (the floor's)
                launch = noop if floor is None else floor.replay
                with least_glued(glued, op, raw, bs, tokens, launch) as call:
                    for _ in range(calls):
                        sync()
                        host.setdefault("least in place", []).append(
                            glued.replay(op, bs, seq_lens, slots, extra, in_place=call)
                        )
            sync()
            row = dict(op=op, raw_bs=raw, bs=bs)
            if route is not None:  # whether SGLang's route replayed a glue graph (unpadded)
                glue = reference.runners[op].decode_runner._metadata_glue
                row["sglang_glue_captured"] = glue.is_captured(route_key)
            for label, samples in host.items():
                if samples:
                    row[f"{label.replace(' ', '_')}_host_us"] = statistics.median(samples)
            for label in arms:
                row[f"{label}_device_us"] = (
                    statistics.median(device[label]) if device[label] else None
                )
            rows.append(row)
    return rows


def glue_pools(arm) -> tuple[int, int, int] | None:
    """(bytes, bytes in use, count) of the CUDA caching allocator's pools other than the default
    pool and the arm's model-graph pool: the glue graphs' (the one pool they share, or one per
    key). In use: what the captured preps keep allocated; the rest is segments held free for the
    next capture."""
    if DEVICE.type != "cuda":
        return None
    ours = {(0, 0), tuple(arm.graphs.pool)}
    pools, used = set(), [0, 0]
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool not in ours:
            pools.add(pool)
            used[0] += segment["total_size"]
            used[1] += segment["active_size"]
    return used[0], used[1], len(pools)


def measure_memory(name: str, sizes, captured) -> dict:
    """The eager and glued arms, each built alone: bytes beyond what the process held before."""
    import gc

    out = {}
    for label in ("eager", "glued"):
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            sync()
        allocated = torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0
        reserved = torch.cuda.memory_reserved() if DEVICE.type == "cuda" else 0
        table = new_req_to_token(sizes, LAUNCHES[name][2])
        arm = build_arm(label, name, sizes, captured, table, reader=False)
        sync()
        figures = dict(keys=len(captured) * 3, glue_pools=glue_pools(arm))
        if DEVICE.type == "cuda":
            figures["allocated"] = torch.cuda.memory_allocated() - allocated
            figures["reserved"] = torch.cuda.memory_reserved() - reserved
        out[label] = figures
        del arm, table
    return out


def timed_captures(monkeypatch) -> dict:
    """Wall time of every glue capture at the server's capture (the queue drained around each),
    per key, by the runner's role."""
    from sglang_dsa_mtp.integration import dsa_metadata_glue as glue

    times: dict[str, list[float]] = {}
    capture_key = glue._capture_key

    def timed(state, forward_batch, key) -> bool:
        sync()
        start = time.perf_counter()
        captured = capture_key(state, forward_batch, key)
        sync()
        mode = forward_batch.forward_mode.name.lower().replace("_", " ")
        role = "draft decode" if len(key) == 1 else mode
        times.setdefault(role, []).append((time.perf_counter() - start) * 1e6)
        return captured

    monkeypatch.setattr(glue, "_capture_key", timed)
    return times


def glue_served(arm) -> dict:
    """Per runner of the glued ``arm``: its glue graphs' replays over every call of the run
    (``routed``, of them ``padded``) and the calls whose prep ran eagerly, by reason."""
    from support import serving_loop

    return {
        op: dict(routed=counts.routed, padded=counts.padded, eager=dict(counts.eager))
        for op, (_, counts) in serving_loop.arm_glues(arm).items()
    }


def print_served(served: dict) -> None:
    print("## What the glued arm's glue served (every call of the run)\n")
    print(markdown_header(["runner", "glue graph replays", "of them padded", "eager, by reason"]))
    for op, counts in served.items():
        eager = "; ".join(f"{why}: {n}" for why, n in counts["eager"].items()) or "-"
        print(markdown_row([op, str(counts["routed"]), str(counts["padded"]), eager]))
    print()


def print_prep(rows: list[dict]) -> None:
    print("## Replay prep per runner, host us (each call in turn, the queue drained before it)\n")
    header = ["op", "live bs", "captured bs"]
    header += [f"{label} host us" for label in ARMS]
    header += ["one graph replay host us", "glue graph alone host us", "glued / one graph replay"]
    header += ["SGLang's glue route host us", "SGLang's glue route / one graph replay"]
    header += [f"{label} device us" for label in ARMS]
    print(markdown_header(header))
    for row in rows:
        print(
            markdown_row(
                [row["op"], str(row["raw_bs"]), str(row["bs"])]
                + [cell(row[f"{label}_host_us"]) for label in ARMS]
                + [cell(row.get("graph_host_us")), cell(row.get("glue_graph_host_us"))]
                + [ratio(row.get("glued_host_us"), row.get("graph_host_us"))]
                + [route_cell(row, "sglang_glue_host_us")]
                + [ratio(row.get("sglang_glue_host_us"), row.get("graph_host_us"))]
                + [cell(row[f"{label}_device_us"]) for label in ARMS]
            )
        )
    print("\n## Warm: the glued prep and the graphs, each repeated alone, host us\n")
    print(
        "In place: the graph replayed where the prep runs, after the runner's same input "
        "copies. Around its graph: the glued prep less its glue graph in place (the plugin's hooks "
        "or SGLang's glue route, and its MetadataGlueGraph). SGLang's glue route: the target verify's prep as "
        "SGLang's own glue replays it, no plugin code in it (padded, marked *: its eager prep).\n"
    )
    header = ["op", "live bs", "captured bs", "glued host us", "one graph replay host us"]
    header += ["one graph replay in place host us", "glue graph alone host us"]
    header += ["glue graph in place host us", "glued around its graph host us"]
    header += ["glued / one graph replay", "glued / one graph replay in place"]
    header += ["SGLang's glue route host us", "SGLang's glue route / one graph replay"]
    header += ["SGLang's glue route / one graph replay in place"]
    print(markdown_header(header))
    for row in rows:
        glued, in_place = row.get("glued_warm_host_us"), row.get("glue_graph_in_place_host_us")
        around = None if glued is None or in_place is None else glued - in_place
        print(
            markdown_row(
                [row["op"], str(row["raw_bs"]), str(row["bs"])]
                + [cell(glued), cell(row.get("graph_warm_host_us"))]
                + [cell(row.get("graph_in_place_host_us"))]
                + [cell(row.get("glue_graph_warm_host_us")), cell(in_place), cell(around)]
                + [ratio(glued, row.get("graph_warm_host_us"))]
                + [ratio(glued, row.get("graph_in_place_host_us"))]
                + [route_cell(row, "sglang_glue_warm_host_us")]
                + [ratio(row.get("sglang_glue_warm_host_us"), row.get("graph_warm_host_us"))]
                + [ratio(row.get("sglang_glue_warm_host_us"), row.get("graph_in_place_host_us"))]
            )
        )
    print_python_around(rows)
    print("\n## Per EAGLE round (draft decode + target verify + draft extend), host us\n")
    print(markdown_header(["live bs", *ARMS, "saved vs eager", "saved vs stock"]))
    for raw in sorted({row["raw_bs"] for row in rows}):
        sums = {
            label: sum(r[f"{label}_host_us"] for r in rows if r["raw_bs"] == raw) for label in ARMS
        }
        print(
            markdown_row(
                [str(raw)]
                + [cell(sums[label]) for label in ARMS]
                + [cell(sums["eager"] - sums["glued"]), cell(sums["stock"] - sums["glued"])]
            )
        )
    print()


def print_python_around(rows: list[dict]) -> None:
    """The warm table of the Python around each glue graph, and how far it leaves the bar."""
    print("\n## Warm: the Python around the glue graph (its launch a no-op), host us\n")
    print(
        "Each in the prep's place, after the glued arm's input copies: a no-op call (the timer's "
        "floor); the glued prep with its glue graph's launch a no-op; the glue's own replay of the "
        "key so. Around its graph: the glued prep less the no-op. Of it, the route: what is not the "
        "glue's replay (the target verify's: SGLang's `_init_replay_attn_metadata`; the draft "
        "runners': SGLang's `HookRegistry` wrapper and the plugin's hook). Least glued: SGLang's "
        "lines up to the plugin's code, run in the prep's place, with the plugin's part one launch "
        "of the one-kernel graph (the target verify unpadded: SGLang's glue route to a "
        "`MetadataGlueGraph` whose replay is that launch; padded, and the draft runners: "
        "`HookRegistry`'s AROUND wrapper of a hook that is that launch), the least any glue "
        "reached through SGLang's code costs.\n"
    )
    header = ["op", "live bs", "captured bs", "no-op in place host us"]
    header += ["glued, launch a no-op host us", "around its graph host us"]
    header += ["of it the glue's replay host us", "of it the route host us"]
    header += ["one graph replay in place host us", "least glued in place host us"]
    header += ["least glued / one graph replay in place"]
    print(markdown_header(header))
    for row in rows:
        floor, whole = row.get("noop_in_place_host_us"), row.get("python_glued_in_place_host_us")
        replay = row.get("python_glue_replay_in_place_host_us")
        if floor is None or whole is None or replay is None:
            continue
        graph, least = row.get("graph_in_place_host_us"), row.get("least_in_place_host_us")
        route = whole - replay
        print(
            markdown_row(
                [row["op"], str(row["raw_bs"]), str(row["bs"]), cell(floor, "{:,.2f}")]
                + [cell(whole, "{:,.2f}"), cell(whole - floor, "{:,.2f}")]
                + [cell(replay - floor, "{:,.2f}"), cell(route, "{:,.2f}")]
                + [cell(graph), cell(least, "{:,.2f}"), ratio(least, graph)]
            )
        )


def route_cell(row: dict, key: str) -> str:
    """SGLang's glue route's figure, marked * where it prepared eagerly (no glue graph: padded)."""
    mark = "" if row.get("sglang_glue_captured", True) else "*"
    return cell(row.get(key)) + (mark if key in row else "")


def ratio(a, b) -> str:
    return cell(None if a is None or b is None else a / b, "{:.2f}")


def print_memory(records: list[dict]) -> None:
    print("## Memory after capture, beyond the process before the arm (MB)\n")
    header = ["max bs", "glue keys", "arm", "allocated", "reserved"]
    header += ["glue graph pools", "of which in use", "pools"]
    print(markdown_header(header))
    for record in records:
        for label in ("eager", "glued"):
            f = record["arms"][label]
            pools = f["glue_pools"]
            print(
                markdown_row(
                    [
                        str(record["max_bs"]),
                        str(f["keys"]),
                        label,
                        cell(None if "allocated" not in f else f["allocated"] / MB, "{:,.3f}"),
                        cell(None if "reserved" not in f else f["reserved"] / MB, "{:,.3f}"),
                        cell(None if pools is None else pools[0] / MB, "{:,.3f}"),
                        cell(None if pools is None else pools[1] / MB, "{:,.3f}"),
                        cell(None if pools is None else pools[2], "{:d}"),
                    ]
                )
            )
    print()


def print_captures(times: dict) -> None:
    print("## Glue capture per key at the server's capture (us)\n")
    print(markdown_header(["runner", "keys", "median", "total (ms)"]))
    for role, samples in sorted(times.items()):
        print(
            markdown_row(
                [
                    role,
                    str(len(samples)),
                    cell(statistics.median(samples)),
                    cell(sum(samples) / 1e3, "{:,.2f}"),
                ]
            )
        )
    print()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.max_bs, args.bs = DRY_RUN["max_bs"], DRY_RUN["bs"]
        args.memory_max_bs, args.calls = DRY_RUN["memory_max_bs"], DRY_RUN["calls"]
    elif DEVICE.type != "cuda":
        print("bench_dsa_metadata_glue needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    import dataclasses

    import pytest
    import triton

    from support import dsa_serving
    from support.sglang_import import sglang_version

    def sizes_for(max_bs: int):
        if args.dry_run:
            return dsa_serving.cpu_sizes(max_bs)
        return dataclasses.replace(dsa_serving.GPU_SIZES, max_bs=max_bs, pool=2 * max_bs + 1)

    if args.dry_run:
        where = "the CPU (dry run: Triton's interpreter, graphs simulated, no figures)"
    else:
        props = torch.cuda.get_device_properties(0)
        where = f"{torch.cuda.get_device_name()}, {props.multi_processor_count} SMs"
    print(
        f"# {where}; torch {torch.__version__}, triton {triton.__version__}, "
        f"SGLang {sglang_version()}\n"
    )
    record = dict(device=where, torch=torch.__version__, triton=triton.__version__)
    record.update(settings=vars(args))
    tokens = LAUNCHES[args.launch][2]
    with pytest.MonkeyPatch.context() as monkeypatch:
        real = real_ops.usable_leaves() if args.real_leaves else []
        record["real leaves"] = real
        print(f"# SGLang's own leaves: {', '.join(real) or 'none (every leaf a stand-in)'}\n")
        dsa_serving.prepare(monkeypatch, DEVICE, real=real)
        captures = timed_captures(monkeypatch)
        memory = []
        for max_bs in args.memory_max_bs:
            sizes = sizes_for(max_bs)
            with dsa_serving.launch(args.launch, sizes) as (_, captured):
                memory.append(
                    dict(max_bs=max_bs, arms=measure_memory(args.launch, sizes, captured))
                )
        record["memory"] = memory
        captures.clear()  # the timed run's captures only
        sizes = sizes_for(args.max_bs)
        with dsa_serving.launch(args.launch, sizes) as (_, captured):
            table = new_req_to_token(sizes, tokens)
            arms = {label: build_arm(label, args.launch, sizes, captured, table) for label in ARMS}
            reference = build_arm(SGLANG_GLUE, args.launch, sizes, captured, table)
            batch_sizes = [bs for bs in args.bs if bs <= max(captured)]
            rows = measure_prep(
                arms, reference, captured, tokens, batch_sizes, args.calls, args.live
            )
            record.update(prep=rows, served=glue_served(arms["glued"]))
            record["captures"] = {role: list(times) for role, times in captures.items()}
            del arms, reference, table
        print_prep(rows)
        print_served(record["served"])
        print_captures(record["captures"])
        print_memory(memory)
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
