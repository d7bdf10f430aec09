"""The EAGLE verify tree between draft and verify for a DSA target: today's FULL_MASK path against
the chain-tree path the plugin's QLEN_ONLY, not-read verify mask opens (``SGLANG_DSA_LIVE_WIDTH``).

Reproduces the table "Verify tree mask" of docs/results.md on the GPU at hand: EAGLE 4/1/5 and
5/1/6 (topk 1), bs 1 / 4 / 16 / 48, a 1M-token context, every request at ``--live`` tokens.

Arms (``support.verify_tree``, SGLang's kernels loaded from its files):

* ``stock``: what SGLang 0.5.23 runs today for a DSA target, which has no verify mask and no
  ``seq_lens_sum``: ``build_tree_kernel_efficient`` allocates and ``torch.full``s a FULL_MASK of
  ``bs x max_context_len x draft tokens`` bools (plus the tree cells), allocates the retrieve and
  position buffers, concatenates the tokens and builds the tree; ``eagle_prepare_for_verify`` then
  assigns the verify cache locations (``assign_extend_cache_locs_uniform_func``). SGLang's tree
  builder on CUDA is a JIT build that needs SGLang's CUDA dependencies, which this benchmark runs
  without: its Triton builder (SGLang's XPU path, the same tree) stands in for it. The mask fill,
  the same as SGLang's, dominates.
* ``ours``: SGLang's fused ``build_chain_tree`` (its path for a QLEN_ONLY mask with topk 1) into the
  preallocated ``max bs x draft tokens^2`` mask, which also returns the cache locations.

Both arms' outputs are checked equal first (``verify_tree.differences``). Figures:

* ``device us``: the arm's launches captured in a CUDA graph, replayed (``test.timing.cuda_graph_time_us``:
  ``--calls`` calls per graph, median of ``--replays`` replays, hot L2). In the graph the FULL_MASK
  comes from the graph's pool, so this is the fill and the kernels, not the allocation.
* ``host us``: eager calls from Python as the worker makes them, allocation included, queued
  without waiting (``test.timing.host_times_us``: 200 calls, median of 21 rounds, arms in turn).
* ``floor us``: the launch gap of a one-element kernel in a graph + the bytes the stock arm's fill
  writes / the measured copy bandwidth (read + write bytes per us), beside the stock figure.

    python test/registered/kernels/benchmark/speculative/bench_verify_tree_mask.py
    python .../bench_verify_tree_mask.py --dry-run   # the same logic on the CPU, small, untimed
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


import torch

from sglang_dsa_mtp.devices import select_device
from support.bench_cli import benchmark_parser
from support.constants import CONTEXT_1M

LAUNCHES = {"4/1/5": 4, "5/1/6": 5}  # EAGLE steps/topk/draft tokens -> steps
MAX_BS = 48  # SGLang's running-request cap in spec mode: the preallocated mask's max bs


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--launch",
        nargs="+",
        default=list(LAUNCHES),
        choices=list(LAUNCHES),
        help="EAGLE launches",
    )
    parser.add_argument(
        "--bs",
        nargs="+",
        type=int,
        default=[1, 4, 16, 48],
        help="batch sizes",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=CONTEXT_1M,
        help="--context-length, the FULL_MASK's max_context_len",
    )
    parser.add_argument("--live", type=int, default=1024, help="tokens of every request")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=30, help="graph replays, median taken")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the arms and the equality check on the CPU through Triton's interpreter, at a "
        "4096-token context and bs 1, 4, without timing",
    )
    return parser


def make_draft(steps: int, bs: int, context: int, live: int, device):
    from support.verify_tree import chain_draft

    return chain_draft(
        [min(live, context - steps - 1)] * bs,
        list(range(bs)),
        steps=steps,
        width=context + 4 + steps + 1,
        max_context_len=context,
        seed=bs,
        device=device,
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = select_device()
    if args.dry_run:
        args.context, args.bs = 4096, [1, 4]
    elif device.type != "cuda":
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    from support.timing import (
        copy_bandwidth_bytes_per_us,
        cuda_graph_time_us,
        host_times_us,
        launch_floor_us,
    )
    from support.verify_tree import (
        chain_verify,
        differences,
        full_mask_numel,
        stock_verify,
    )

    timed = not args.dry_run
    floor_us = launch_floor_us(args.calls, args.replays) if timed else None
    bandwidth = copy_bandwidth_bytes_per_us() if timed else None
    where = torch.cuda.get_device_name() if timed else "CPU (dry run, untimed)"
    print(
        f"{where}; context {args.context}; every request at {min(args.live, args.context)} tokens\n"
    )
    print(
        "| EAGLE | bs | FULL_MASK MB | stock device us | ours device us | floor us | "
        "stock host us | ours host us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    status = 0
    for launch in args.launch:
        steps = LAUNCHES[launch]
        tokens = steps + 1
        buffer = torch.zeros(MAX_BS * tokens * tokens, dtype=torch.bool, device=device)
        for bs in args.bs:
            draft = make_draft(steps, bs, args.context, args.live, device)
            diffs = differences(draft, chain_verify(draft, buffer), stock_verify(draft))
            if diffs:
                print(f"EAGLE {launch} bs {bs}: outputs differ in {diffs}", file=sys.stderr)
                status = 1
            mask_bytes = full_mask_numel(draft)  # bool: one byte a cell
            cells = ["-"] * 5
            if timed:
                arms = {
                    "stock": lambda: stock_verify(draft),
                    "ours": lambda: chain_verify(draft, buffer),
                }
                device_us = {
                    name: cuda_graph_time_us(fn, calls=args.calls, replays=args.replays)
                    for name, fn in arms.items()
                }
                host_us = host_times_us(arms)
                cells = [
                    f"{device_us['stock']:.1f}",
                    f"{device_us['ours']:.1f}",
                    f"{floor_us + mask_bytes / bandwidth:.1f}",
                    f"{host_us['stock']:.1f}",
                    f"{host_us['ours']:.1f}",
                ]
            print(f"| {launch} | {bs} | {mask_bytes / 1e6:,.1f} | " + " | ".join(cells) + " |")
    print("\noutputs equal in every row" if status == 0 else "\nOUTPUTS DIFFER (see above)")
    return status


if __name__ == "__main__":
    sys.exit(main())
