"""MTP draft-decode replay metadata at a 1M-token table: stock precompute + copies vs one launch.

Reproduces the spec's table "MTP draft-decode metadata" on the GPU at hand: 3 draft step backends
(EAGLE 4/1/5) and 4 (EAGLE 5/1/6), live KV 1k and 64k, bs 1 / 4 / 16, every request at the same live
length, table width 1,048,640, physical page 64, index top-k 2048, every step backend with
``page_table_1`` and ``real_page_table`` (as under speculative decoding). Each figure is microseconds
per call, CUDA-graph replays with a cold L2 (``test.timing.cuda_graph_time_us``: 20 calls per graph,
median of 30 replays, a 256 MiB memset before each call, the memsets' own graph subtracted).

Arms:

* ``stock``: SGLang 0.5.23's path at kpool 1 (``dsa_backend_mtp_precompute._precompute_decode_mode``
  and the copies of ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph``): SGLang's
  own ``fused_dsa_decode_metadata`` (loaded from SGLang's file by ``reference.metadata_module``) into a
  freshly allocated ``torch.empty`` scratch (bs x width page table, bs x cdiv(width, 64) compact table,
  length vectors), then a full-width copy of every scratch buffer into each step backend, one torch
  ``copy_`` per buffer (``metadata_cases.run_stock_draft_decode``). SGLang itself copies with its JIT
  CUDA kernels ``fused_metadata_copy_multi_cuda`` (step backends 0-2, one launch) and
  ``fused_metadata_copy_cuda`` (each further one); those need SGLang's dependencies, which a machine running
  from the wheel's files (``test/gpu_env.sh``) lacks. The copies here are their documented equivalent: the same bytes moved, in
  separate launches (1 + 6 per step backend, where SGLang makes 2 + (step backends - 3)), so this
  arm carries more launch gaps than SGLang's. ``stock foreach`` moves the same bytes with one
  ``torch._foreach_copy_`` over every (destination, source) pair
  (``run_stock_draft_decode(..., foreach=True)``), in fewer launches. At 4 step backends SGLang also
  refreshes the DeepGEMM paged-MQA schedule of step 3 (the spec's "plus, at 5/1/6, the step-3
  schedule refresh"); DeepGEMM is one of those dependencies too, so no stand-in is timed: the stock
  arm at 4 step backends leaves that refresh out and understates SGLang's time by it. The per-step
  work both paths keep (FlashMLA metadata under ``flashmla_kv``, ``forward_metadata``) is not timed.
* ``one launch``: ours, ``fused_dsa_draft_decode_metadata_multi`` into every step backend.
* ``bounded decode``: ``fused_dsa_decode_metadata_bounded`` into one step backend, for scale.

Beside each point: the floor = the launch gap of a one-element kernel in a graph + the bytes the one
launch must move (live ``req_to_token`` columns read once, live ``page_table_1`` and
``real_page_table`` columns written once per step backend, the length vectors) / the measured
device-to-device copy bandwidth, and ``one launch / floor``: the one launch against a single bounded
launch moving the same bytes at the floor. ``stock scratch MiB``: what the stock path allocates per
replay (bs x width x 4 + bs x cdiv(width, 64) x 4 + the length vectors), no longer allocated by the one
launch.

    python test/registered/kernels/benchmark/attention/bench_dsa_draft_decode_metadata.py
    # with --json FILE for every measurement; tuning sweep of our kernel's tunables:
    python .../bench_dsa_draft_decode_metadata.py --arms one_launch --tune TILE_N=256,512
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import traceback

import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_common as common
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
from support.constants import WIDTH_1M
from support.metadata_cases import (
    make_case,
    run_draft_decode_multi,
    run_stock_draft_decode,
)
from support.timing import (
    copy_bandwidth_bytes_per_us,
    cuda_graph_time_us,
    launch_floor_us,
)

WIDTH = WIDTH_1M  # cdiv(WIDTH, 128) = 8193 column blocks
PAGE = 64
TOPK = 2048
EAGLE = {3: "3 (EAGLE 4/1/5)", 4: "4 (EAGLE 5/1/6)"}  # step backends: speculative_num_steps - 1
ARMS = ("stock", "stock_foreach", "one_launch", "bounded")
COLUMN = {"stock": "stock", "stock_foreach": "stock foreach", "bounded": "bounded decode"}


def vector_bytes(bs: int) -> int:
    """One step backend's length vectors: cache / dsa seqlens (bs each), both cumsums (bs + 1)."""
    return 4 * (4 * bs + 2)


def bytes_moved(lengths: list[int], steps: int) -> int:
    """Fewest bytes the one launch must move: live req_to_token columns read once per request,
    live page-table columns (both tables) and the length vectors written once per step backend,
    the int64 seq_lens and req_pool_indices read."""
    bs, moved = len(lengths), 0
    for live in lengths:
        cols = min(WIDTH, triton.cdiv(live, 128) * 128)
        moved += 4 * cols + steps * 4 * (cols + triton.cdiv(cols, PAGE))
    return moved + steps * vector_bytes(bs) + 16 * bs


def scratch_bytes(bs: int) -> int:
    """What the stock path allocates with torch.empty on every replay."""
    return 4 * bs * (WIDTH + triton.cdiv(WIDTH, PAGE)) + vector_bytes(bs)


def check_one_launch(case, outs) -> None:
    """Before timing: every step backend's buffers equal the bounded decode kernel's, bit for bit."""
    run_draft_decode_multi(case, outs)
    expected = case.run("bounded", case.outputs())
    for i, out in enumerate(outs):
        for name, tensor in expected.items():
            if tensor is not None and not torch.equal(tensor, out[name]):
                raise AssertionError(f"one launch: step backend {i}'s {name} differs")


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--steps", default="3,4", help="draft step backends, comma-separated, each 1 to 4"
    )
    parser.add_argument(
        "--live", default="1024,65536", help="live KV lengths in tokens, comma-separated"
    )
    parser.add_argument("--bs", default="1,4,16", help="batch sizes, comma-separated")
    add_mixed_argument(parser)
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"arms to time, comma-separated, any of {ARMS}"
    )
    add_timing_arguments(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dsa_draft_decode_metadata needs a CUDA GPU", file=sys.stderr)
        return 2
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms takes a comma-separated subset of {ARMS}, got {args.arms!r}")
    steps_list, lives, batch_sizes = (
        parse_list(args.steps),
        parse_list(args.live),
        parse_list(args.bs),
    )
    variants = parse_tune(args.tune)

    launch = launch_floor_us(calls=args.calls, replays=args.replays)
    bandwidth = copy_bandwidth_bytes_per_us()
    props = torch.cuda.get_device_properties(0)
    print(
        f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}; width {WIDTH}, page {PAGE}, topk {TOPK}, "
        f"{'hot' if args.hot_l2 else 'cold'} L2; default budget "
        f"{default_budget(torch.device('cuda'))}"
    )
    print(
        f"# launch floor {launch:.2f} us, copy bandwidth {bandwidth / 1e6:.2f} TB/s (read + write)"
    )
    print(
        "# stock = SGLang's decode kernel into a torch.empty scratch + torch copies into every step "
        "backend (SGLang's JIT copy kernels and DeepGEMM are not on this machine: see the docstring)"
    )

    req_to_token = torch.randint(
        0, 1 << 30, (2 * max(batch_sizes), WIDTH), dtype=torch.int32, device="cuda"
    )
    columns = [COLUMN[a] for a in ("stock", "stock_foreach") if a in arms]
    if "one_launch" in arms:
        columns += [variant_name(v).replace("ours", "one launch", 1) for v in variants]
    if "bounded" in arms:
        columns.append(COLUMN["bounded"])
    header = ["step backends", "live KV", "bs", *columns, "floor", "one launch / floor"]
    header += ["stock scratch MiB", "one launch fastest"]
    print(markdown_header(header))
    records = []
    for steps, live, bs, mixed in sweep_points(steps_list, lives, batch_sizes, args.mixed):
        lengths = batch_lengths(live, bs, mixed)
        case = make_case(
            "decode",
            lengths,
            width=WIDTH,
            device="cuda",
            page_size=PAGE,
            topk=TOPK,
            req_to_token=req_to_token,
        )
        outs = [case.outputs() for _ in range(steps)]
        check_one_launch(case, outs)
        row = {}

        def timed(name, fn):
            try:
                row[name] = cuda_graph_time_us(
                    fn, calls=args.calls, replays=args.replays, cold_l2=not args.hot_l2
                )
            except Exception:  # report the arm as missing, keep the others
                traceback.print_exc(file=sys.stderr)
                row[name] = None

        if "stock" in arms:
            timed(COLUMN["stock"], lambda: run_stock_draft_decode(case, outs))
        if "stock_foreach" in arms:
            timed(
                COLUMN["stock_foreach"],
                lambda: run_stock_draft_decode(case, outs, foreach=True),
            )
        ours = []
        if "one_launch" in arms:
            for variant in variants:
                name = variant_name(variant).replace("ours", "one launch", 1)
                with tunables(common, variant) as budget:
                    timed(name, lambda: run_draft_decode_multi(case, outs, budget=budget))
                ours.append(row[name])
        if "bounded" in arms:
            timed(COLUMN["bounded"], lambda: case.run("bounded", outs[0]))
        floor = launch + bytes_moved(lengths, steps) / bandwidth
        best = min((t for t in ours if t is not None), default=None)
        stock = [row[COLUMN[a]] for a in ("stock", "stock_foreach") if a in arms]
        stock = [t for t in stock if t is not None]
        label = f"{live // 1024}k" + (" mixed" if mixed else "")
        cells = [EAGLE.get(steps, str(steps)), label, str(bs)]
        cells += ["-" if row[c] is None else f"{row[c]:.1f}" for c in columns]
        cells += [f"{floor:.1f}", "-" if best is None else f"{best / floor:.2f}"]
        cells.append(f"{scratch_bytes(bs) / 2**20:.1f}")
        fastest = "-" if best is None or not stock else fastest_verdict(best, stock)
        cells.append(fastest)
        print(markdown_row(cells), flush=True)
        records.append(
            dict(
                steps=steps,
                live=live,
                bs=bs,
                mixed=mixed,
                floor_us=floor,
                bytes_moved=bytes_moved(lengths, steps),
                stock_scratch_bytes=scratch_bytes(bs),
                **row,
            )
        )
    if args.json:
        write_json(
            args.json,
            measurements(
                gpu=props.name, launch_floor_us=launch, copy_bytes_per_us=bandwidth, points=records
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
