"""Replay-metadata kernels at a 1M-token table: SGLang unbounded vs SGLang KPool (index_kpool=1) vs ours.

Reproduces the spec's table "Replay metadata, 1M-token table, 5 verify rows per request" on the GPU
at hand: ops decode / target verify / draft extend, live KV 1k and 64k, bs 1 / 4 / 16, every request
at the same live length, physical page 64, index top-k 2048. Each figure is microseconds per call,
CUDA-graph replays with a cold L2 (``test.timing.cuda_graph_time_us``: 20 calls per graph, median of 30
replays, a 256 MiB memset before each call, the memsets' own graph subtracted). Beside each point:
the floor = the launch gap of a one-element kernel in a graph + the bytes the op must move (live
``req_to_token`` columns read once per request, live page-table columns written) / the measured
device-to-device copy bandwidth.

    python test/registered/kernels/benchmark/attention/bench_dsa_metadata_bounded.py
    # tuning sweep of our kernel's tunables:
    python .../bench_dsa_metadata_bounded.py --arms bounded --tune TILE_N=256,512 --tune budget=528,1056
    # per-call time against the live length, 1k to 1M, drawn with the floors (matplotlib):
    python .../bench_dsa_metadata_bounded.py --live 1024,4096,16384,65536,262144,1048576 --bs 1,16 \
        --json sweep.json --plot sweep.png
    # the same plot from an earlier run's --json file, on any machine (no GPU needed):
    python .../bench_dsa_metadata_bounded.py --plot-from sweep.json --plot sweep.png

``--host`` times host microseconds per call instead, what runs on the CPU before every graph replay
(wrapper + launch; 200 back-to-back calls with the GPU work queued, arms in turn, median of 21
rounds), each arm called as the server calls it, on the same buffers at every call:

* decode, target verify, draft extend: ``sglang`` is SGLang's kernel wrapper with the keyword
  arguments of its replay; ``ours`` is what the plugin puts in its place, our wrapper behind the
  per-bs fallback (``integration.fallback.Fallback``), its launch bound by its warm-up as at the
  capture of the bs, with the same arguments;
* ``draft_decode`` (the MTP draft-decode replay, ``--steps`` step backends): ``sglang`` is its
  precompute (a ``torch.empty`` scratch and SGLang's decode kernel) plus the copies into every step
  backend, one ``torch._foreach_copy_`` standing in for SGLang's JIT copy kernel (not on a machine
  running from SGLang's files); ``sglang precompute`` is the precompute alone, a floor for SGLang's
  arm whatever its copy costs; ``ours`` is the one launch as the plugin's replay calls it, through
  the launch bound once (``launch.Binder.bind``, as the plugin binds it at the capture of the bs).

    python .../bench_dsa_metadata_bounded.py --host --live 1024 --bs 1,4,16 \
        --ops decode,verify,draft_extend,draft_decode
    # the same arms once each on the CPU (Triton's interpreter, a 300-column table), untimed:
    python .../bench_dsa_metadata_bounded.py --host --dry-run --live 256 --bs 1,2 \
        --ops decode,verify,draft_extend,draft_decode

The host floor, one PyTorch kernel launch from Python (a one-element ``add_``), is timed in the same
run as the arms, once before the table (``host_floor_us`` of the ``--json`` record) and at every
point as one more arm, in turn with the others in every round (the point's ``host_floor_us``, the
table's ``one launch``, which ``ours / one launch`` divides by).
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import functools
import importlib.util
import json
import time

from sglang_dsa_mtp.devices import select_device

select_device()  # before Triton is imported: on a CPU (--dry-run), Triton's interpreter

import torch
import triton

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_common as common
from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import (
    ONE_LAUNCH_BINDER,
    fused_dsa_draft_decode_metadata_multi,
)
from sglang_dsa_mtp.kernels.ops.host import default_budget
from support.bench_cli import (
    add_mixed_argument,
    add_timing_arguments,
    batch_lengths,
    benchmark_parser,
    fastest_verdict,
    markdown_header,
    markdown_row,
    measurements,
    parse_list,
    parse_tune,
    sweep_points,
    tunables,
    variant_name,
    write_json,
)
from support.constants import SMALL_WIDTH, WIDTH_1M
from support.metadata_cases import (
    draft_decode_multi_kwargs,
    kernel_for,
    make_case,
    run_stock_draft_decode,
    stock_scratch,
)
from support.timing import (
    copy_bandwidth_bytes_per_us,
    cuda_graph_time_us,
    host_times_us,
    launch_floor_us,
    written_call,
)

WIDTH = WIDTH_1M  # cdiv(WIDTH, 128) = 8193 column blocks
PAGE = 64
NEXT_N = 5
FLOOR_ARM = "one torch launch"  # the host floor, timed as one more arm at every point
OP_NAMES = {
    "decode": "decode",
    "verify": "target verify",
    "draft_extend": "draft extend",
    "draft_decode": "MTP draft decode",
}
ARMS = ("sglang", "sglang_kpool", "bounded")
# The plot's curves: measurement key -> legend label (and a curve per variant of ours).
PLOTTED = {"sglang": "SGLang unbounded", "sglang_kpool": "SGLang KPool, kpool 1", "ours": "ours"}


def bytes_moved(case) -> int:
    """Fewest bytes the op must move: each request's live req_to_token columns once, its live
    page-table columns written once per output row (both tables), plus the small length vectors."""
    add = case.next_n if case.op == "verify" else 0
    rows_per_request = case.rows // case.bs
    total = 0
    for seq in case.seq_lens.tolist():
        cols = min(case.width, triton.cdiv(seq + add, 128) * 128)
        total += cols + rows_per_request * (cols + triton.cdiv(cols, PAGE))
    return 4 * (total + 6 * case.rows)


def time_arm(case, arm, out, args, overrides=None) -> float:
    """Microseconds per call of ``arm``; ``overrides`` set our tunables for this measurement."""
    with tunables(common, overrides) as budget:
        return cuda_graph_time_us(
            lambda: case.run(arm, out, budget=budget),
            calls=args.calls,
            replays=args.replays,
            cold_l2=not args.hot_l2,
        )


def host_calls(op, case, out, steps: int) -> dict:
    """Each host arm of ``op`` on ``case`` (a decode case for ``draft_decode``), bound to its
    arguments and buffers, called as the server calls it."""
    kwargs = case.kwargs(out)
    if op != "draft_decode":
        sglang = kernel_for(case.op, "sglang")
        ours = Fallback(kernel_for(case.op, "bounded"), sglang, what=case.op)
        ours.warm_up(**kwargs)  # binds the launch, as at the capture of the bs
        return {
            "sglang": written_call(sglang, kwargs),
            "ours": written_call(ours.installed, kwargs),
        }
    outs = [case.outputs() for _ in range(steps)]

    def precompute():
        scratch = stock_scratch(case)
        kernel_for("decode", "sglang")(**case.kwargs(scratch))

    # The plugin's replay (``write_draft_decode_metadata``): the launch bound at the capture of
    # the bs, else the wrapper.
    kwargs = draft_decode_multi_kwargs(case, outs)
    bound, _ = ONE_LAUNCH_BINDER.bind(**kwargs)
    fixed = {n: v for n, v in kwargs.items() if n not in ("seq_lens", "req_pool_indices")}

    def ours():
        call = dict(fixed, seq_lens=case.seq_lens, req_pool_indices=case.req_pool_indices)
        if bound is None or not bound(call):
            fused_dsa_draft_decode_metadata_multi(**call)

    return {
        "sglang": functools.partial(run_stock_draft_decode, case, outs, foreach=True),
        "sglang precompute": precompute,
        "ours": ours,
    }


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--ops",
        default="decode,verify,draft_extend",
        help=f"ops to time, comma-separated, any of {tuple(OP_NAMES)}; draft_decode (the MTP "
        "replay) with --host only",
    )
    parser.add_argument(
        "--live",
        default="1024,65536",
        help="live KV lengths in tokens, comma-separated, each at most the table width "
        f"({WIDTH}) minus next_n; 1024,4096,16384,65536,262144,1048576 for the plot",
    )
    parser.add_argument("--bs", default="1,4,16", help="batch sizes, comma-separated")
    add_mixed_argument(parser)
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"arms to time, comma-separated, any of {ARMS}"
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="host us per call (wrapper + launch) of SGLang's call and ours, not GPU time",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="--host draft_decode: MTP draft step backends (1-4)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"with --host: call every arm once on the CPU (Triton's interpreter, a {SMALL_WIDTH}-"
        "column table), untimed: checks the arms and the table, measures nothing",
    )
    add_timing_arguments(parser)
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw per-call time against the live length, one panel per op and batch size, each "
        "arm with the floors (needs matplotlib, the bench extra)",
    )
    parser.add_argument(
        "--plot-from",
        metavar="DATA.json",
        help="with --plot: draw from an earlier run's --json file instead of running (no GPU)",
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from draws a plot: give --plot FILE.png")
        with open(args.plot_from) as f:
            save_plot(json.load(f), args.plot)
        print(f"plot: {args.plot}")
        return 0
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            "--plot needs matplotlib (the bench extra); or write --json here and draw it "
            "elsewhere with --plot-from"
        )
    if args.host and (args.tune or args.plot):
        parser.error("--host times the wrappers with our default tunables; drop --tune and --plot")
    if not set(args.ops.split(",")) <= set(OP_NAMES):
        parser.error(f"--ops takes a comma-separated subset of {tuple(OP_NAMES)}, got {args.ops!r}")
    if "draft_decode" in args.ops.split(",") and not args.host:
        parser.error(
            "draft_decode is timed on the GPU by bench_dsa_draft_decode_metadata.py; here with --host"
        )
    if not set(args.arms.split(",")) <= set(ARMS):
        parser.error(f"--arms takes a comma-separated subset of {ARMS}, got {args.arms!r}")
    if args.dry_run and not args.host:
        parser.error("--dry-run checks the --host arms; add --host")
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_dsa_metadata_bounded needs a CUDA GPU (or --host --dry-run)", file=sys.stderr)
        return 2

    ops, lives, batch_sizes = args.ops.split(","), parse_list(args.live), parse_list(args.bs)
    arms = args.arms.split(",")
    variants = parse_tune(args.tune)
    device = torch.device("cpu" if args.dry_run else "cuda")
    width = SMALL_WIDTH if args.dry_run else WIDTH
    time_host = _call_once if args.dry_run else host_times_us
    if args.dry_run:
        name, launch, bandwidth = "CPU (dry run: every arm called once, untimed)", 0.0, 1.0
        print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}; width {width}")
    else:
        launch = launch_floor_us(calls=args.calls, replays=args.replays)
        bandwidth = copy_bandwidth_bytes_per_us()
        props = torch.cuda.get_device_properties(0)
        name = props.name
        print(
            f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
            f"triton {triton.__version__}; width {WIDTH}, page {PAGE}, next_n {NEXT_N}, "
            f"{'host time per call' if args.host else ('hot' if args.hot_l2 else 'cold') + ' L2'}; "
            f"default budget {default_budget(device)}"
        )
        print(
            f"# launch floor {launch:.2f} us, copy bandwidth {bandwidth / 1e6:.2f} TB/s "
            "(read + write)"
        )

    floor_host = None
    one = torch.zeros(1, device=device)  # the host floor's one-element add_
    if args.host:
        floor_host = time_host({"one torch launch": lambda: one.add_(1)})["one torch launch"]
        print(
            f"# host floor: one PyTorch kernel launch (a one-element add_) costs {floor_host:.1f} us"
        )

    req_to_token = torch.randint(
        0, 1 << 30, (2 * max(batch_sizes), width), dtype=torch.int32, device=device
    )
    if args.host:
        columns = ["sglang", "sglang precompute", "ours"]
    else:
        columns = [a for a in arms if a != "bounded"]
        if "bounded" in arms:
            columns += [variant_name(v) for v in variants]
    if args.host:
        tail = ["ours - sglang", "one launch", "ours / one launch"]
    else:
        tail = ["floor", "best ours / floor", "ours fastest"]
    header = ["op", "live KV", "bs", *columns, *tail]
    print(markdown_header(header))
    records = []
    for op, live, bs, mixed in sweep_points(ops, lives, batch_sizes, args.mixed):
        case = make_case(
            "decode" if op == "draft_decode" else op,
            batch_lengths(live, bs, mixed),
            width=width,
            device=device,
            next_n=NEXT_N,
            page_size=PAGE,
            req_to_token=req_to_token,
        )
        out = case.outputs()
        row = {}
        if args.host:  # every arm and the host floor, arguments bound beforehand, timed in turn
            arms = {**host_calls(op, case, out, args.steps), FLOOR_ARM: lambda: one.add_(1)}
            row = time_host(arms)
            row["host_floor_us"] = row.pop(FLOOR_ARM)
        for arm in [] if args.host else arms:
            if arm != "bounded":
                row[arm] = time_arm(case, arm, out, args)
                continue
            for variant in variants:
                row[variant_name(variant)] = time_arm(case, arm, out, args, variant)
        floor = launch + bytes_moved(case) / bandwidth
        ours = [v for k, v in row.items() if k.startswith("ours")]
        label = _live_label(live) + (" mixed" if mixed else "")
        cells = [OP_NAMES[op], label, str(bs)]
        cells += [f"{row[c]:.1f}" if c in row else "-" for c in columns]
        if args.host:
            over = min(ours) - row["sglang"] if ours and "sglang" in row else None
            point_floor = row["host_floor_us"]
            cells += [f"{over:+.1f}" if over is not None else "-", f"{point_floor:.1f}"]
            cells += [f"{min(ours) / point_floor:.2f}" if ours else "-"]
        else:
            sglang = [row[a] for a in ("sglang", "sglang_kpool") if a in row]
            fastest = fastest_verdict(min(ours), sglang) if ours and sglang else "-"
            cells += [f"{floor:.1f}", f"{min(ours) / floor:.2f}" if ours else "-", fastest]
        print(markdown_row(cells), flush=True)
        records.append(dict(op=op, live=live, bs=bs, mixed=mixed, floor_us=floor, **row))
    host_floor = {"host_floor_us": floor_host} if args.host else {}
    record = measurements(
        gpu=name,
        launch_floor_us=launch,
        copy_bytes_per_us=bandwidth,
        **host_floor,
        timing="host" if args.host else "cuda graph",
        l2="hot" if args.hot_l2 else "cold",
        width=width,
        page=PAGE,
        next_n=NEXT_N,
        points=records,
    )
    if args.json:
        write_json(args.json, record)
    if args.plot:
        save_plot(record, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _call_once(fns: dict) -> dict:
    """The dry run's stand-in for ``host_times_us``: each function called once, the host
    microseconds of that one call (with Triton's interpreter: no measurement of anything)."""
    times = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        times[name] = (time.perf_counter() - start) * 1e6
    return times


def _live_label(live: int) -> str:
    return f"{live >> 20}M" if live >= 1 << 20 else f"{live >> 10}k"


def plot_sweep(record: dict):
    """A matplotlib Figure of ``record`` (what ``--json`` writes): one panel per op (rows) and
    batch size (columns), microseconds per call against the live KV length on log axes, a curve
    per arm of ``PLOTTED`` that was measured, the floor of each point (launch gap + bytes /
    bandwidth, dashed) and the launch gap alone (dotted)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    if record.get("timing", "cuda graph") != "cuda graph":
        raise ValueError("the plot shows GPU time per call; this file holds --host times")
    points = record["points"]
    ops = [op for op in OP_NAMES if any(p["op"] == op for p in points)]
    batch_sizes = sorted({p["bs"] for p in points})
    if not ops:
        raise ValueError("no points to plot")
    fig = Figure(figsize=(4.8 * len(batch_sizes), 3.4 * len(ops)), layout="constrained")
    axes = fig.subplots(len(ops), len(batch_sizes), squeeze=False, sharex=True, sharey="row")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    sparse = FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else "")
    for row, op in enumerate(ops):
        for col, bs in enumerate(batch_sizes):
            ax = axes[row][col]
            series = [p for p in points if p["op"] == op and p["bs"] == bs and not p.get("mixed")]
            series.sort(key=lambda p: p["live"])
            lives = [p["live"] for p in series]
            ours = sorted({k for p in series for k in p if k.startswith("ours")})
            curves = [(k, v) for k, v in PLOTTED.items() if k != "ours"] + [(k, k) for k in ours]
            for key, label in curves:
                if series and all(key in p for p in series):
                    ax.plot(lives, [p[key] for p in series], marker="o", label=label)
            floors = [p["floor_us"] for p in series]
            ax.plot(lives, floors, "k--", label="floor: launch gap + bytes / bandwidth")
            ax.axhline(record["launch_floor_us"], color="gray", linestyle=":", label="launch gap")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(sparse)
            ax.set_xticks(lives, [_live_label(live) for live in lives])
            ax.set_title(f"{OP_NAMES[op]}, bs {bs}")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("us per call")
            if row == len(ops) - 1:
                ax.set_xlabel("live KV length (tokens)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 3))
    l2 = f", {record['l2']} L2" if "l2" in record else ""
    fig.suptitle(f"DSA replay metadata per call, CUDA-graph replays, {record['gpu']}{l2}")
    return fig


def save_plot(record: dict, path: str) -> None:
    plot_sweep(record).savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
