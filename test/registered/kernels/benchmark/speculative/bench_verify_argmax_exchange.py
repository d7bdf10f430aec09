"""Target verify, one round of LM head + greedy pick on one GPU: SGLang's full logits against the
target-verify argmax exchange (beyond docs/spec.md).

Reproduces "Target verify (LM head + pick), one GPU" of docs/results.md: vocab 154880, hidden 6144,
a bf16 LM head, EAGLE 4/1/5 and 5/1/6 (5 and 6 verify rows a request), bs 1 / 4 / 16 / 48. One GPU
is TP 1, where SGLang gathers nothing; what the gather would move per round at TP 2 / 4 / 8 is
computed beside, as is the exchange buffer the plugin all-reduces instead.

Arms, each one verify round, ``--calls`` rounds captured back to back in one CUDA graph; each of
``--replays`` rounds replays every arm once, in turn, so that clock and power drift reach all alike
(median replay / calls, microseconds):

* ``GEMM``: the LM head alone, as SGLang's plain path runs it (``torch.matmul`` of the hidden states
  and the bf16 weight's transpose).
* ``stock``: the LM head, SGLang's own ``cast_to_float32_logits`` (its ``softcap.py``, loaded from
  its file) into the fp32 ``[rows, vocab]`` logits buffer, and ``torch.argmax`` of that buffer (the
  EAGLE verify's greedy pick).
* ``ours``: the LM head, ``draft_argmax_partials`` and the ``propagate`` finalize (at TP 1 there is
  nothing to all-reduce).
* ``stock pick`` / ``ours pick``: the same two without the LM head.

Before timing, both arms' tokens are checked equal. ``floor``: the bytes of one read of the bf16
logits over the measured device-to-device copy bandwidth (read + write bytes per microsecond), the
least any pick must move; ``ours pick / bound``: ours pick over the most it may take (from 80
rows 1.5 x (floor + launch floor), up to 20 rows 2 launch floors + floor), met or not printed after
the table. ``gather MB``: the bf16 logits one rank receives per round at TP n,
``rows x vocab x 2 x (n - 1) / n``; ``exchange KB``: the fp32 exchange buffer at TP n,
``rows x n x splits x 16`` bytes (``splits`` = ``SPLIT_N``-column splits of a rank's shard).

    source test/gpu_env.sh && python3 test/registered/kernels/benchmark/speculative/bench_verify_argmax_exchange.py
    python3 .../bench_verify_argmax_exchange.py --dry-run   # the arms and the check on the CPU, untimed
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
from support.argmax_cases import HIDDEN, VOCAB, padded_shard_width  # noqa: E402
from support.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    write_json,
)

LAUNCHES = {"4/1/5": 5, "5/1/6": 6}  # EAGLE steps/topk/draft tokens -> verify rows a request
TP_SIZES = (2, 4, 8)
ARMS = ("GEMM", "stock", "ours", "stock pick", "ours pick")
DRY_RUN = dict(vocab=1001, hidden=64, bs=[1, 4])


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--launch", nargs="+", default=list(LAUNCHES), choices=list(LAUNCHES), help="EAGLE launches"
    )
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 4, 16, 48], help="batch sizes")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size")
    parser.add_argument("--calls", type=int, default=10, help="rounds per CUDA graph")
    parser.add_argument("--replays", type=int, default=50, help="timed rounds, median taken")
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"run the arms and the token check on the CPU through Triton's interpreter, at vocab "
        f"{DRY_RUN['vocab']}, hidden {DRY_RUN['hidden']}, bs {DRY_RUN['bs']}, without timing",
    )
    return parser


class Round:
    """One verify round's tensors at ``rows`` rows and every arm's body."""

    def __init__(self, weight: torch.Tensor, rows: int, vocab: int, seed: int):
        from support.reference import softcap_module

        generator = torch.Generator().manual_seed(seed)
        device = weight.device
        self.weight, self.vocab = weight, vocab
        self.hidden = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        self.hidden = self.hidden.to(device)
        self.logits = self.gemm()
        self.buffer = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.layout = dap.partials_layout(
            shard_width=weight.shape[0], tp_rank=0, tp_size=1, vocab_size=vocab
        )
        self.cast = softcap_module().cast_to_float32_logits

    def gemm(self):
        return torch.matmul(self.hidden, self.weight.T)

    def stock_pick(self, logits=None):
        logits = self.logits if logits is None else logits
        self.cast(logits[:, : self.vocab], self.buffer)
        return torch.argmax(self.buffer, dim=-1)

    def ours_pick(self, logits=None):
        logits = self.logits if logits is None else logits
        exchange = dap.launch_partials(self.layout, logits)
        return dap.launch_finalize(exchange, propagate_nan=True)[1].view(-1)

    def bodies(self) -> dict:
        return {
            "GEMM": self.gemm,
            "stock": lambda: self.stock_pick(self.gemm()),
            "ours": lambda: self.ours_pick(self.gemm()),
            "stock pick": self.stock_pick,
            "ours pick": self.ours_pick,
        }


def per_tp(rows: int, vocab: int) -> dict:
    """Bytes per round at each TP size: the gather a rank receives, the exchange buffer."""
    out = {}
    for tp in TP_SIZES:
        shard = padded_shard_width(vocab, tp)
        out[tp] = dict(
            gather_bytes=rows * vocab * 2 * (tp - 1) / tp,
            exchange_bytes=rows * tp * dap.splits_per_rank(shard) * dap.LANES * 4,
        )
    return out


def pick_bound_us(rows: int, floor_us: float, launch_floor_us: float):
    """The most the pick (partials + finalize) may take at ``rows`` rows: 1.5 x (one read of the
    bf16 logits + one launch floor) from 80 rows on, 2 launch floors + the read up to 20 rows;
    None in between (no bound)."""
    if rows >= 80:
        return 1.5 * (floor_us + launch_floor_us)
    if rows <= 20:
        return 2 * launch_floor_us + floor_us
    return None


def bound_verdict(points: list) -> str:
    """One line per bound: met, or the row counts where the pick exceeds it."""
    lines = []
    for name, test in (
        ("from 80 rows, ours pick <= 1.5 x (floor + launch floor)", lambda rows: rows >= 80),
        ("up to 20 rows, ours pick <= 2 launch floors + floor", lambda rows: rows <= 20),
    ):
        bounded = [p for p in points if test(p["rows"])]
        missed = [p["rows"] for p in bounded if p["us"]["ours pick"] > p["pick_bound_us"]]
        if bounded:
            lines.append(f"{name}: " + (f"MISSED at rows {missed}" if missed else "met"))
    return "\n".join(lines)


def cell(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    timed = not args.dry_run
    if args.dry_run:
        args.vocab, args.hidden, args.bs = DRY_RUN["vocab"], DRY_RUN["hidden"], DRY_RUN["bs"]
    elif DEVICE.type != "cuda":
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(0)
    width = padded_shard_width(args.vocab, 1)
    weight = torch.zeros(width, args.hidden, dtype=torch.bfloat16)
    weight[: args.vocab] = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.05).to(
        torch.bfloat16
    )
    weight = weight.to(DEVICE)
    floors = {}
    if timed:
        from support.timing import floors_text, graph_floors, interleaved_graphs_us

        floors = graph_floors()
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {floors_text(floors)}"
    else:
        where = "CPU (dry run: each arm once, untimed)"
    timing = f"; {args.calls} rounds per graph, median of {args.replays} replays, us per round"
    print(
        f"# Target verify, LM head + greedy pick, TP 1: vocab {args.vocab}, hidden {args.hidden}, "
        f"bf16 head\n\n{where}{timing if timed else ''}\n"
    )
    tp_cells = [f"gather MB / exchange KB TP{tp}" for tp in TP_SIZES]
    header = ["EAGLE", "bs", "rows", *ARMS, "stock - ours", "floor", "ours pick / bound", *tp_cells]
    print(markdown_header(header))
    points, status = [], 0
    for launch in args.launch:
        for bs in args.bs:
            rows = bs * LAUNCHES[launch]
            round_ = Round(weight, rows, args.vocab, seed=rows)
            if not torch.equal(round_.stock_pick(), round_.ours_pick()):
                print(f"EAGLE {launch} bs {bs}: the arms' tokens differ", file=sys.stderr)
                status = 1
            times = dict.fromkeys(ARMS)
            floor = bound = None
            if not timed:
                for body in round_.bodies().values():
                    body()
            else:
                times = interleaved_graphs_us(round_.bodies(), args.calls, args.replays)
                floor = rows * args.vocab * 2 / floors["copy_bytes_per_us"]
                bound = pick_bound_us(rows, floor, floors["launch_floor_us"])
            moved = per_tp(rows, args.vocab)
            saved = None if times["stock"] is None else times["stock"] - times["ours"]
            print(
                markdown_row(
                    [
                        launch,
                        str(bs),
                        str(rows),
                        *(cell(times[arm]) for arm in ARMS),
                        cell(saved),
                        cell(floor),
                        "-" if bound is None else f"{times['ours pick'] / bound:.2f}",
                        *(
                            f"{moved[tp]['gather_bytes'] / 1e6:.1f} / "
                            f"{moved[tp]['exchange_bytes'] / 1e3:.1f}"
                            for tp in TP_SIZES
                        ),
                    ]
                )
            )
            points.append(
                dict(
                    launch=launch,
                    bs=bs,
                    rows=rows,
                    us=times,
                    floor_us=floor,
                    pick_bound_us=bound,
                    per_tp=moved,
                )
            )
    print("\ntokens equal in every row" if status == 0 else "\nTOKENS DIFFER (see above)")
    if timed:
        print(bound_verdict(points))
    if args.json:
        write_json(args.json, dict(args=vars(args), **floors, points=points))
    return status


if __name__ == "__main__":
    sys.exit(main())
