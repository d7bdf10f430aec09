"""The greedy pick alone (argmax partials + finalize) at the draft's and the target verify's row
counts and shard widths, on one GPU; optionally against another copy of the partials module.

Reproduces "The pick alone" of docs/results.md: vocab 154880, bf16 logits of one rank's shard
(SGLang's padded ``ParallelLMHead`` shard at TP 1 / 2 / 8, rank 0), seeded random values with the
edge rows of the differential tests planted (ties, -0.0, +-inf, NaN). Draft rows (1 / 2 / 4 / 8 /
16) take the draft decode's finalize (``sanitize``, positions advanced, the draft-token column
written), verify rows (EAGLE 4/1/5 and 5/1/6 at bs 1 / 4 / 16 / 48) the ``propagate`` finalize.
At TP > 1 the exchange is not all-reduced (one GPU): the finalize reads every rank's slots, the
others zero.

Arms, each pick ``--calls`` times back to back in one CUDA graph, the graphs of a point replayed
in turn ``--replays`` times (median replay / calls, microseconds): ``ours`` (the partials module as
it ships) and, with ``--baseline FILE``, ``baseline`` (the module at ``FILE``, for example an
earlier commit's: ``git show REV:PATH`` of this package's
``kernels/ops/speculative/draft_argmax_partials.py``).
Before timing, each arm's tokens are checked against ``torch.argmax`` of the fp32 cast
(``propagate``) or SGLang's rule (``sanitize``: NaN as -1e30). ``floor``: one read of the shard's
bf16 logits at the measured copy bandwidth (read + write bytes per microsecond) plus one launch
floor.

    source test/gpu_env.sh
    python3 test/registered/kernels/benchmark/speculative/bench_argmax_pick.py --baseline OLD.py
    python3 .../bench_argmax_pick.py --dry-run   # the arms and the token check on the CPU, untimed
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


import torch

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before any kernel module is imported: on a CPU, Triton's interpreter

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap  # noqa: E402
from support.argmax_cases import VOCAB, padded_shard_width  # noqa: E402
from support.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    write_json,
)
from support.scripts import load_script  # noqa: E402

DRAFT_ROWS = (1, 2, 4, 8, 16)
VERIFY_ROWS = (5, 20, 24, 80, 96, 240, 288)
DRY_RUN = dict(vocab=3001, tp=[1, 2], draft_rows=[1, 4], verify_rows=[5])


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2, 8], help="shard widths of TP")
    parser.add_argument(
        "--draft-rows", nargs="+", type=int, default=list(DRAFT_ROWS), help="draft decode rows"
    )
    parser.add_argument(
        "--verify-rows", nargs="+", type=int, default=list(VERIFY_ROWS), help="target verify rows"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--baseline", type=Path, help="another draft_argmax_partials.py to time")
    parser.add_argument("--calls", type=int, default=10, help="picks per CUDA graph")
    parser.add_argument("--replays", type=int, default=50, help="timed rounds, median taken")
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"run the arms and the token check on the CPU through Triton's interpreter, at vocab "
        f"{DRY_RUN['vocab']}, TP {DRY_RUN['tp']}, without timing",
    )
    return parser


def planted_logits(rows: int, width: int, seed: int) -> torch.Tensor:
    """Seeded bf16 logits, the edge cases planted in the last rows where there are enough."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=generator) * 3).to(torch.bfloat16)
    plants = (
        lambda row: row.fill_(float("-inf")),
        lambda row: row.index_fill_(0, torch.tensor([5, width - 1]), float("nan")),
        lambda row: row.zero_().index_fill_(0, torch.tensor([3, 7]), -0.0),
        lambda row: row.index_fill_(0, torch.tensor([width // 3, width - 1]), float("inf")),
        lambda row: row.fill_(float("nan")),
    )
    if rows >= len(plants):
        for row, plant in zip(logits[rows - len(plants) :], plants):
            plant(row)
    return logits.to(DEVICE)


def expected_tokens(logits: torch.Tensor, vocab: int, sanitize: bool) -> torch.Tensor:
    """The gathered path's token, rank 0's shard standing for every rank's (the other ranks'
    columns are below every value here, as their zero slots say)."""
    valid = logits[:, : min(logits.shape[1], vocab)].float()
    if sanitize:
        valid = torch.nan_to_num(valid, nan=-1e30, posinf=float("inf"), neginf=float("-inf"))
    return torch.argmax(valid, dim=-1)


class Pick:
    """One arm: a partials module's pick at one shape, on persistent buffers."""

    def __init__(self, module, logits: torch.Tensor, tp: int, vocab: int, sanitize: bool):
        rows, width = logits.shape
        self.module, self.logits, self.sanitize = module, logits, sanitize
        self.layout = module.partials_layout(
            shard_width=width, tp_rank=0, tp_size=tp, vocab_size=vocab
        )
        self.exchange = torch.empty(
            module.exchange_shape(rows, width, tp), dtype=torch.float32, device=DEVICE
        )
        self.positions = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
        self.draft_tokens = torch.zeros((rows, 4), dtype=torch.int64, device=DEVICE)

    def __call__(self) -> torch.Tensor:
        self.module.launch_partials(self.layout, self.logits, self.exchange)
        if self.sanitize:
            return self.module.launch_finalize(
                self.exchange, self.positions, self.draft_tokens, 3, propagate_nan=False
            )[1]
        return self.module.launch_finalize(self.exchange, propagate_nan=True)[1]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    timed = not args.dry_run
    if args.dry_run:
        args.vocab, args.tp = DRY_RUN["vocab"], DRY_RUN["tp"]
        args.draft_rows, args.verify_rows = DRY_RUN["draft_rows"], DRY_RUN["verify_rows"]
    elif DEVICE.type != "cuda":
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    modules = {"ours": dap}
    if args.baseline is not None:
        if not args.baseline.is_file():
            raise SystemExit(f"--baseline: no file {args.baseline}")
        modules["baseline"] = load_script(args.baseline)
    floors = {}
    if timed:
        import triton

        from support.timing import floors_text, graph_floors, interleaved_graphs_us

        floors = graph_floors()
        where = (
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
            f"{triton.__version__}; {floors_text(floors)}; {args.calls} picks per graph, "
            f"median of {args.replays} replays, us per pick"
        )
    else:
        where = "CPU (dry run: each arm once, untimed)"
    print(f"# The pick alone (partials + finalize), vocab {args.vocab}, bf16 logits\n\n{where}\n")
    arms = list(modules)
    header = ["call site", "TP", "shard", "rows", *arms, "floor"]
    if "baseline" in modules:
        header.append("ours - baseline")
    print(markdown_header(header))
    points, status = [], 0
    for site, rows_list, sanitize in (
        ("draft decode", args.draft_rows, True),
        ("target verify", args.verify_rows, False),
    ):
        for tp in args.tp:
            width = padded_shard_width(args.vocab, tp)
            for rows in rows_list:
                logits = planted_logits(rows, width, seed=rows * 8 + tp)
                expected = expected_tokens(logits, args.vocab, sanitize)
                bodies = {
                    arm: Pick(module, logits, tp, args.vocab, sanitize)
                    for arm, module in modules.items()
                }
                for arm, body in bodies.items():
                    if not torch.equal(body().view(-1), expected):
                        print(f"{site} TP {tp} rows {rows}: {arm}'s tokens differ", file=sys.stderr)
                        status = 1
                times = dict.fromkeys(arms)
                floor = None
                if timed:
                    times = interleaved_graphs_us(bodies, args.calls, args.replays)
                    floor = (
                        rows * width * 2 / floors["copy_bytes_per_us"] + floors["launch_floor_us"]
                    )
                cells = [site, str(tp), str(width), str(rows)]
                cells += ["-" if times[a] is None else f"{times[a]:.1f}" for a in arms]
                cells.append("-" if floor is None else f"{floor:.1f}")
                if "baseline" in modules:
                    saved = None if floor is None else times["ours"] - times["baseline"]
                    cells.append("-" if saved is None else f"{saved:+.1f}")
                print(markdown_row(cells))
                points.append(
                    dict(site=site, tp=tp, shard=width, rows=rows, us=times, floor_us=floor)
                )
    print("\ntokens as expected in every row" if status == 0 else "\nTOKENS DIFFER (see above)")
    if args.json:
        settings = dict(vars(args), baseline=None if args.baseline is None else str(args.baseline))
        write_json(args.json, dict(args=settings, **floors, points=points))
    return status


if __name__ == "__main__":
    sys.exit(main())
