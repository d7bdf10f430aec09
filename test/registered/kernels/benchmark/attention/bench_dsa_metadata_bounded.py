"""Replay-metadata kernels at a 1M-token table: SGLang unbounded vs SGLang KPool (index_kpool=1) vs ours.

Reproduces the spec's table "Replay metadata, 1M-token table, 5 verify rows per request" on the GPU
at hand: ops decode / target verify / draft extend, live KV 1k and 64k, bs 1 / 4 / 16, every request
at the same live length, physical page 64, index top-k 2048. Each figure is microseconds per call,
CUDA-graph replays with a cold L2 (``selfcheck.cuda_graph_time_us``: 20 calls per graph, median of 30
replays, a 256 MiB memset before each call, the memsets' own graph subtracted). Beside each point:
the floor = the launch gap of a one-element kernel in a graph + the bytes the op must move (live
``req_to_token`` columns read once per request, live page-table columns written) / the measured
device-to-device copy bandwidth.

    python test/registered/kernels/benchmark/attention/bench_dsa_metadata_bounded.py
    # tuning sweep of our kernel (tile width, budget):
    python .../bench_dsa_metadata_bounded.py --arms bounded --tile-n 512,1024,2048 --budget 512,1056,2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.reference_cases import make_case
from sglang_dsa_mtp.selfcheck import cuda_graph_time_us

WIDTH = 1_048_640  # cdiv(WIDTH, 128) = 8193 column blocks
PAGE = 64
NEXT_N = 5
OP_NAMES = {"decode": "decode", "verify": "target verify", "draft_extend": "draft extend"}


def parse_list(text, cast=int):
    return [None if item == "default" else cast(item) for item in text.split(",")]


def launch_floor_us(args) -> float:
    one = torch.zeros(1, device="cuda")
    return cuda_graph_time_us(lambda: one.add_(1), calls=args.calls, replays=args.replays)


def copy_bandwidth_bytes_per_us() -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return 2 * src.numel() / statistics.median(times)


def bytes_moved(case) -> int:
    """Fewest bytes the op must move: live req_to_token columns once per request, live page-table
    columns written once per output row (both tables), plus the small length vectors."""
    kv = int(case.seq_lens[0]) + (case.next_n if case.op == "verify" else 0)
    cols = min(case.width, triton.cdiv(kv, 128) * 128)
    rows = case.rows
    return 4 * (case.bs * cols + rows * (cols + triton.cdiv(cols, PAGE)) + 6 * rows)


def variant_name(tile_n, budget, num_warps) -> str:
    return f"ours t{tile_n} b{budget or 'def'} w{num_warps}"


def time_arm(case, arm, out, args, tile_n=None, budget=None, num_warps=None) -> float:
    """Microseconds per call of ``arm``; ``tile_n`` / ``num_warps`` override our module defaults."""
    defaults = bounded.TILE_N, bounded.NUM_WARPS
    bounded.TILE_N = tile_n or bounded.TILE_N
    bounded.NUM_WARPS = num_warps or bounded.NUM_WARPS
    try:
        return cuda_graph_time_us(
            lambda: case.run(arm, out, budget=budget),
            calls=args.calls,
            replays=args.replays,
            cold_l2=not args.hot_l2,
        )
    finally:
        bounded.TILE_N, bounded.NUM_WARPS = defaults


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="decode,verify,draft_extend")
    parser.add_argument("--live", default="1024,65536", help="live KV lengths")
    parser.add_argument("--bs", default="1,4,16")
    parser.add_argument("--arms", default="sglang,sglang_kpool,bounded")
    parser.add_argument("--tile-n", default=str(bounded.TILE_N), help="our tile widths to sweep")
    parser.add_argument("--budget", default="default", help="our budgets to sweep ('default')")
    parser.add_argument(
        "--num-warps", default=str(bounded.NUM_WARPS), help="our warp counts to sweep"
    )
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--hot-l2", action="store_true", help="skip the cold-L2 memsets")
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dsa_metadata_bounded needs a CUDA GPU", file=sys.stderr)
        return 2

    ops, lives, batch_sizes = args.ops.split(","), parse_list(args.live), parse_list(args.bs)
    arms = args.arms.split(",")
    variants = [
        (t, b, w)
        for t in parse_list(args.tile_n)
        for b in parse_list(args.budget)
        for w in parse_list(args.num_warps)
    ]
    launch = launch_floor_us(args)
    bandwidth = copy_bandwidth_bytes_per_us()
    props = torch.cuda.get_device_properties(0)
    print(
        f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}; width {WIDTH}, page {PAGE}, next_n {NEXT_N}, "
        f"{'hot' if args.hot_l2 else 'cold'} L2; default budget "
        f"{bounded.default_budget(torch.device('cuda'))}"
    )
    print(
        f"# launch floor {launch:.2f} us, copy bandwidth {bandwidth / 1e6:.2f} TB/s (read + write)"
    )

    req_to_token = torch.randint(
        0, 1 << 30, (2 * max(batch_sizes), WIDTH), dtype=torch.int32, device="cuda"
    )
    columns = [a for a in arms if a != "bounded"]
    if "bounded" in arms:
        columns += [variant_name(*v) for v in variants]
    header = ["op", "live KV", "bs", *columns, "floor", "best ours / floor"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    records = []
    for op in ops:
        for live in lives:
            for bs in batch_sizes:
                case = make_case(
                    op,
                    [live] * bs,
                    width=WIDTH,
                    device="cuda",
                    next_n=NEXT_N,
                    page_size=PAGE,
                    req_to_token=req_to_token,
                )
                out = case.outputs()
                row = {}
                for arm in arms:
                    if arm != "bounded":
                        row[arm] = time_arm(case, arm, out, args)
                        continue
                    for variant in variants:
                        row[variant_name(*variant)] = time_arm(case, arm, out, args, *variant)
                floor = launch + bytes_moved(case) / bandwidth
                ours = [v for k, v in row.items() if k.startswith("ours")]
                ratio = f"{min(ours) / floor:.2f}" if ours else "-"
                cells = [OP_NAMES[op], f"{live // 1024}k", str(bs)]
                cells += [f"{row[c]:.1f}" for c in columns] + [f"{floor:.1f}", ratio]
                print("| " + " | ".join(cells) + " |", flush=True)
                records.append(dict(op=op, live=live, bs=bs, floor_us=floor, **row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    gpu=props.name,
                    launch_floor_us=launch,
                    copy_bytes_per_us=bandwidth,
                    points=records,
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
