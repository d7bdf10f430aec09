"""Indexer logits past the SM count: SGLang's full-width concat vs the live-column copy.

Reproduces the tables "Indexer logits past the SM count" of docs/results.md on the GPU at hand. One
call is what one top-k layer of a target verify (SM90) or a draft extend does with its paged-MQA
logits: ``rows`` query rows (requests x draft tokens), table width 1,048,640 (SGLang's default 1M
context), every row at the same live length, chunks of ``--sm-count`` rows (default: the device's
SM count, what SGLang's ``Indexer.sm_count`` is). Each figure is microseconds per call, CUDA-graph
replays (``test.timing.cuda_graph_time_us``: 20 calls per graph, median of 30 replays, cold L2 unless
``--hot-l2``).

DeepGEMM comes with SGLang's CUDA dependencies, which this benchmark runs without. Its
``fp8_paged_mqa_logits`` is stood in for by a function that allocates its output the way DeepGEMM
does (``[rows, align(width, 256)]`` fp32, viewed ``[:, :width]``) and writes the live columns as
DeepGEMM does, in whole 64-token KV blocks (a ``fill_`` of
``[:, :64 * cdiv(live, 64)]``): the bytes DeepGEMM writes, none of its arithmetic
(``test.indexer_cases.StandInCall``). Its chunk schedule is a ``[sm_count + 1, 2]`` buffer.

Arms, each with that stand-in as the logits function:

* ``chunks``: the stand-in called once per chunk, nothing joined: the part both arms share;
* ``stock``: SGLang 0.5.23's ``deepgemm_paged_mqa_logits_split`` with its ``_chunked_fp8_paged_mqa_logits``
  closure (both loaded from SGLang's files): the chunks, then ``torch.cat`` at full width;
* ``ours``: ``chunked_paged_mqa_logits_live``: the same chunks, each copied live columns only into
  one output.

Columns: ``stock join`` / ``ours join`` = the arm minus ``chunks``; ``ours floor`` = one launch gap
per chunk + the live bytes the copy moves (rows x live columns x 4, read and written) / the measured
copy bandwidth; ``saving`` = stock - ours; ``pool MiB``: the peak of the CUDA-graph memory pool while
one call is captured (``test.timing.graph_pool_peak_bytes``). At or below the SM count SGLang makes
one logits call and no concat, and the plugin's hook leaves that call alone: the ``ours`` column there
is the live copy of one chunk, for scale only.

The projection table multiplies the saving per call by the layers that compute top-k in one round's
target verify (``--layers``; DeepSeek-V3.2 61, GLM-5 78, GLM-5.2 with IndexShare 21:
docs/indexer-cliff.md) plus one for the draft extend of the NextN layer, which has the same rows.

    python test/registered/kernels/benchmark/attention/bench_dsa_indexer_live_logits.py
    # with --json FILE for every measurement; on a CPU, the logic at tiny sizes, untimed:
    python test/registered/kernels/benchmark/attention/bench_dsa_indexer_live_logits.py --dry-run
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before any kernel module is imported (sets TRITON_INTERPRET on a CPU)

import torch  # noqa: E402
import triton  # noqa: E402

from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live  # noqa: E402
from support import indexer_cases as cases  # noqa: E402
from support.bench_cli import (  # noqa: E402
    add_timing_arguments,
    benchmark_parser,
    markdown_header,
    markdown_row,
    measurements,
    parse_list,
    parse_tune,
    tunables,
    variant_name,
    write_json,
)
from support.constants import WIDTH_1M  # noqa: E402
from support.timing import (  # noqa: E402
    copy_bandwidth_bytes_per_us,
    cuda_graph_time_us,
    graph_pool_peak_bytes,
    launch_floor_us,
)

DEFAULT_LAYERS = "DeepSeek-V3.2=61,GLM-5=78,GLM-5.2 IndexShare=21"
DRY_RUN = dict(rows="3,5,9", live="64,200", width=256, sm_count=4)


def check(call: cases.StandInCall) -> None:
    """Before timing: our live columns are the concat's, bit for bit."""
    differing = call.mismatches()
    if differing:
        raise AssertionError(f"rows {differing[:8]} differ from SGLang's concat")


def live_bytes(rows: int, live_len: int, width: int) -> int:
    """What the live copy must move: every row's live 64-column blocks, read and written."""
    cols = min(width, triton.cdiv(live_len, 64) * 64)
    return 2 * 4 * rows * cols


def parse_layers(text: str) -> list[tuple[str, int]]:
    pairs = [item.rpartition("=") for item in text.split(",")]
    return [(name, int(count)) for name, _, count in pairs]


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", default="130,135,160,240", help="query rows per call")
    parser.add_argument("--live", default="1024,65536,1048576", help="live tokens per row")
    parser.add_argument("--width", type=int, default=WIDTH_1M, help="logits width (columns)")
    parser.add_argument(
        "--sm-count", type=int, help="chunk rows (SGLang's Indexer.sm_count); default: the GPU's"
    )
    parser.add_argument(
        "--layers", default=DEFAULT_LAYERS, help="top-k layers per target verify, NAME=COUNT,..."
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"check the arms once at tiny sizes, untimed (runs on a CPU): {DRY_RUN}",
    )
    add_timing_arguments(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        rows_list, lives = parse_list(DRY_RUN["rows"]), parse_list(DRY_RUN["live"])
        width, sm_count = DRY_RUN["width"], DRY_RUN["sm_count"]
    elif DEVICE.type != "cuda":
        print("bench_dsa_indexer_live_logits needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    else:
        rows_list, lives, width = parse_list(args.rows), parse_list(args.live), args.width
        props = torch.cuda.get_device_properties(0)
        sm_count = args.sm_count or props.multi_processor_count
    layers = parse_layers(args.layers)
    variants = parse_tune(args.tune)
    timed = not args.dry_run

    if timed:
        launch = launch_floor_us(calls=args.calls, replays=args.replays)
        bandwidth = copy_bandwidth_bytes_per_us()
        live.warm_up(DEVICE)
        print(
            f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
            f"triton {triton.__version__}; width {width}, chunks of {sm_count} rows, "
            f"{'hot' if args.hot_l2 else 'cold'} L2; logits: DeepGEMM stand-in (see the docstring)"
        )
        print(
            f"# launch floor {launch:.2f} us, copy bandwidth {bandwidth / 1e6:.2f} TB/s "
            "(read + write)"
        )
    else:
        launch = bandwidth = None
        print(f"# dry run on {DEVICE}: width {width}, chunks of {sm_count} rows, untimed")

    names = [variant_name(v) for v in variants]
    header = ["rows", "live", "chunks", "stock", *names, "stock join", "ours join"]
    header += ["ours floor", "saving", "stock pool MiB", "ours pool MiB"]
    print(markdown_header(header))
    records, savings = [], {}

    def us(fn):
        """Microseconds per call (None untimed); each call's logits are dropped right after it, as
        the indexer drops them after its top-k, so the graph pool is reused call after call."""
        if not timed:
            fn()
            return None
        return cuda_graph_time_us(
            lambda: (fn(), None)[1], calls=args.calls, replays=args.replays, cold_l2=not args.hot_l2
        )

    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    for rows in rows_list:
        for live_len in lives:
            call = cases.StandInCall(rows, live_len, width, sm_count, DEVICE)
            check(call)
            row = dict(rows=rows, live=live_len, chunks=us(call.chunks), stock=us(call.stock))
            for variant, name in zip(variants, names):
                with tunables(live, variant) as budget:
                    row[name] = us(lambda: call.ours(budget))
            ours = row[names[0]]
            joins = [None if t is None else t - row["chunks"] for t in (row["stock"], ours)]
            floor = None
            if timed:
                floor = triton.cdiv(rows, sm_count) * launch
                floor += live_bytes(rows, live_len, width) / bandwidth
                row["stock_pool_bytes"] = graph_pool_peak_bytes(call.stock)
                row["ours_pool_bytes"] = graph_pool_peak_bytes(call.ours)
                if rows > sm_count:
                    savings[(rows, live_len)] = row["stock"] - ours
            row.update(ours_floor_us=floor, live_bytes=live_bytes(rows, live_len, width))
            mib = [row.get(f"{arm}_pool_bytes") for arm in ("stock", "ours")]
            cells = [str(rows), str(live_len), str(triton.cdiv(rows, sm_count))]
            cells += [cell(row["stock"])] + [cell(row[name]) for name in names]
            cells += [cell(j) for j in joins] + [cell(floor)]
            cells.append(cell(None if ours is None else row["stock"] - ours))
            cells += [cell(None if b is None else b / 2**20, "{:.0f}") for b in mib]
            print(markdown_row(cells), flush=True)
            records.append(row)

    print()
    print(
        "# projected saving per round, ms: (stock - ours) x (top-k layers + 1 draft extend layer)"
    )
    print(markdown_header(["rows", "live", *(f"{name} ({n} + 1)" for name, n in layers)]))
    for (rows, live_len), saving in savings.items():
        cells = [str(rows), str(live_len)]
        cells += [f"{saving * (n + 1) / 1000:.2f}" for _, n in layers]
        print(markdown_row(cells))
    if not savings:
        print(markdown_row(["-", "-", *("-" for _ in layers)]))
    if args.json and timed:
        write_json(
            args.json,
            measurements(
                gpu=props.name, launch_floor_us=launch, copy_bytes_per_us=bandwidth, points=records
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
