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
* ``previous pick``: ``ours pick`` with the partials kernel it replaced (one program per row and
  2048-column split, one load each: ``testing/argmax_previous.py``), timed in the same rounds.

Before timing, the arms' tokens are checked equal. ``floor``: the bytes of one read of the bf16
logits over the measured device-to-device copy bandwidth (read + write bytes per microsecond), the
least any pick must move; ``x floor``: a pick over the floor plus one launch floor (the one-element
kernel of a graph). Two more tables time the picks alone, ours against the previous: the verify
pick on one rank's shard at TP 8 (19,360 columns of vocab 154880: the partials of rank 0 and the
``propagate`` finalize, no all-reduce), and the draft decode pick (the ``sanitize`` finalize with
positions and a draft-token column) on one rank's shard at TP 2 / 4 / 8, rows 1-48. ``gather MB``: the bf16 logits one rank receives per round at TP n,
``rows x vocab x 2 x (n - 1) / n``; ``exchange KB``: the fp32 exchange buffer at TP n,
``rows x n x splits x 16`` bytes (``splits`` = 2048-column splits of a rank's shard).

    source test/gpu_env.sh && python3 test/registered/kernels/benchmark/speculative/bench_verify_argmax_exchange.py
    python3 .../bench_verify_argmax_exchange.py --dry-run   # the arms and the check on the CPU, untimed
"""

from __future__ import annotations

import statistics
import sys
from typing import Optional

import torch
import triton

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before any kernel module is imported: on a CPU, Triton's interpreter

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap  # noqa: E402
from sglang_dsa_mtp.testing.argmax_cases import (  # noqa: E402
    HIDDEN,
    VOCAB,
    padded_shard_width,
    pick_state,
)
from sglang_dsa_mtp.testing.argmax_previous import launch_previous_partials  # noqa: E402
from sglang_dsa_mtp.testing.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    write_json,
)

LAUNCHES = {"4/1/5": 5, "5/1/6": 6}  # EAGLE steps/topk/draft tokens -> verify rows a request
TP_SIZES = (2, 4, 8)
ARMS = ("GEMM", "stock", "ours", "stock pick", "ours pick", "previous pick")
PICKS = ("ours pick", "previous pick")
SHARD_TP = 8  # the verify pick on one rank's shard at this TP size
DRAFT_ROWS = (1, 2, 4, 8, 16, 32, 48)
DRAFT_TP_SIZES = (2, 4, 8)
DRY_RUN = dict(vocab=1001, hidden=64, bs=[1, 4], draft_rows=[2])


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
    parser.add_argument(
        "--draft-rows", nargs="+", type=int, default=list(DRAFT_ROWS), help="draft pick rows"
    )
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"run the arms and the token check on the CPU through Triton's interpreter, at vocab "
        f"{DRY_RUN['vocab']}, hidden {DRY_RUN['hidden']}, bs {DRY_RUN['bs']}, draft rows "
        f"{DRY_RUN['draft_rows']}, without timing",
    )
    return parser


class Round:
    """One verify round's tensors at ``rows`` rows and every arm's body."""

    def __init__(self, weight: torch.Tensor, rows: int, vocab: int, seed: int):
        from sglang_dsa_mtp.testing.reference import softcap_module

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
        return verify_pick(dap.launch_partials, self.layout, logits)

    def bodies(self) -> dict:
        return {
            "GEMM": self.gemm,
            "stock": lambda: self.stock_pick(self.gemm()),
            "ours": lambda: self.ours_pick(self.gemm()),
            "stock pick": self.stock_pick,
            **shard_picks(self.layout, self.logits, draft=False),
        }


PARTIALS = dict(zip(PICKS, (dap.launch_partials, launch_previous_partials)))


def verify_pick(partials, layout, logits):
    """The target verify's pick: ``partials`` (ours or the previous kernel), the propagate finalize."""
    return dap.launch_finalize(partials(layout, logits), propagate_nan=True)[1].view(-1)


def shard_picks(layout, logits, *, draft: bool) -> dict:
    """Both picks on one rank's shard: the verify's, or the draft decode's (the sanitize finalize,
    positions advanced, the last draft-token column written)."""
    if not draft:
        return {
            name: lambda partials=partials: verify_pick(partials, layout, logits)
            for name, partials in PARTIALS.items()
        }
    positions, draft_tokens = pick_state(logits.shape[0], logits.device)

    def draft_pick(partials):
        exchange = partials(layout, logits)
        _, tokens = dap.launch_finalize(exchange, positions, draft_tokens, 3, propagate_nan=False)
        return tokens.view(-1)

    return {
        name: lambda partials=partials: draft_pick(partials) for name, partials in PARTIALS.items()
    }


def interleaved_us(bodies: dict, calls: int, replays: int) -> dict:
    """Median microseconds per call of each body, its graph of ``calls`` calls replayed in turn
    with the others ``replays`` times."""
    from sglang_dsa_mtp.testing.timing import capture_graph, replay_us

    graphs = {
        name: capture_graph(lambda body=body: [body() for _ in range(calls)])[0]
        for name, body in bodies.items()
    }
    for graph in graphs.values():
        graph.replay()
    times = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            times[name].append(replay_us(graph))
    return {name: statistics.median(t) / calls for name, t in times.items()}


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


def cell(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


class Timer:
    """The run's floors and timing: ``measure`` checks the tokens of every body but the
    ``unchecked`` against ``expected`` (recording a mismatch), then times them interleaved."""

    def __init__(self, args):
        self.args, self.timed, self.status, self.floors = args, not args.dry_run, 0, {}
        if self.timed:
            from sglang_dsa_mtp.testing.timing import copy_bandwidth_bytes_per_us, launch_floor_us

            self.floors = dict(
                launch_floor_us=launch_floor_us(), copy_bytes_per_us=copy_bandwidth_bytes_per_us()
            )

    def measure(self, what: str, bodies: dict, expected: torch.Tensor, unchecked=()) -> dict:
        for name, body in bodies.items():
            if name not in unchecked and not torch.equal(body(), expected):
                print(f"{what}: {name}'s tokens differ", file=sys.stderr)
                self.status = 1
        if not self.timed:
            return dict.fromkeys(bodies)
        return interleaved_us(bodies, self.args.calls, self.args.replays)

    def floor_us(self, logits: torch.Tensor) -> Optional[float]:
        """One read of ``logits`` at the copy bandwidth."""
        if not self.timed:
            return None
        return logits.numel() * logits.element_size() / self.floors["copy_bytes_per_us"]

    def over_floor(self, times: dict, floor: Optional[float]) -> str:
        """Each pick over the floor plus one launch floor: ``ours / previous``."""
        if floor is None:
            return "-"
        bound = floor + self.floors["launch_floor_us"]
        return " / ".join(f"{times[name] / bound:.2f}" for name in PICKS)

    def where(self) -> str:
        if not self.timed:
            return "CPU (dry run: each arm once, untimed)"
        return (
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
            f"{triton.__version__}; launch floor {self.floors['launch_floor_us']:.2f} us, copy "
            f"bandwidth {self.floors['copy_bytes_per_us'] / 1e6:.2f} TB/s (read + write); "
            f"{self.args.calls} rounds per graph, median of {self.args.replays} replays, us per round"
        )


def verify_table(timer: Timer, weight: torch.Tensor) -> tuple[list, list]:
    """The LM head + pick table at TP 1, and the pick on one TP-8 rank's shard of the same logits."""
    args = timer.args
    tp_cells = [f"gather MB / exchange KB TP{tp}" for tp in TP_SIZES]
    ratio = "x floor ours / previous"
    print(
        markdown_header(["EAGLE", "bs", "rows", *ARMS, "stock - ours", "floor", ratio, *tp_cells])
    )
    points, rounds = [], []
    for launch in args.launch:
        for bs in args.bs:
            rows = bs * LAUNCHES[launch]
            round_ = Round(weight, rows, args.vocab, seed=rows)
            rounds.append((launch, bs, round_))
            times = timer.measure(
                f"EAGLE {launch} bs {bs}", round_.bodies(), round_.stock_pick(), unchecked=["GEMM"]
            )
            floor = timer.floor_us(round_.logits[:, : args.vocab])
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
                        timer.over_floor(times, floor),
                        *(
                            f"{moved[tp]['gather_bytes'] / 1e6:.1f} / "
                            f"{moved[tp]['exchange_bytes'] / 1e3:.1f}"
                            for tp in TP_SIZES
                        ),
                    ]
                )
            )
            points.append(
                dict(launch=launch, bs=bs, rows=rows, us=times, floor_us=floor, per_tp=moved)
            )
    width = padded_shard_width(args.vocab, SHARD_TP)
    print(
        f"\n## The verify pick on one rank's shard at TP {SHARD_TP} ({width} columns: rank 0's "
        f"partials and the propagate finalize, no all-reduce)\n"
    )
    print(markdown_header(["EAGLE", "bs", "rows", *PICKS, "floor", ratio]))
    layout = dap.partials_layout(
        shard_width=width, tp_rank=0, tp_size=SHARD_TP, vocab_size=args.vocab
    )
    shard_points = []
    for launch, bs, round_ in rounds:
        shard = round_.logits[:, :width].contiguous()
        expected = torch.argmax(shard.float(), dim=-1)
        bodies = shard_picks(layout, shard, draft=False)
        times = timer.measure(f"TP {SHARD_TP} shard, EAGLE {launch} bs {bs}", bodies, expected)
        floor = timer.floor_us(shard)
        rows = shard.shape[0]
        print(
            markdown_row(
                [launch, str(bs), str(rows), *(cell(times[name]) for name in PICKS), cell(floor)]
                + [timer.over_floor(times, floor)]
            )
        )
        shard_points.append(
            dict(launch=launch, bs=bs, rows=rows, width=width, us=times, floor_us=floor)
        )
    return points, shard_points


def draft_table(timer: Timer) -> list:
    """The draft decode pick on one rank's shard at each TP size: ours against the previous."""
    args = timer.args
    print(
        "\n## The draft decode pick on one rank's shard (rank 0's partials and the sanitize "
        "finalize with positions and a draft-token column, no all-reduce)\n"
    )
    print(markdown_header(["TP", "width", "rows", *PICKS, "previous - ours", "floor"]))
    generator = torch.Generator().manual_seed(1)
    points = []
    for tp in DRAFT_TP_SIZES:
        width = padded_shard_width(args.vocab, tp)
        layout = dap.partials_layout(
            shard_width=width, tp_rank=0, tp_size=tp, vocab_size=args.vocab
        )
        for rows in args.draft_rows:
            logits = (torch.randn(rows, width, generator=generator) * 4).to(torch.bfloat16)
            logits = logits.to(DEVICE)
            expected = torch.argmax(logits.float(), dim=-1)
            bodies = shard_picks(layout, logits, draft=True)
            times = timer.measure(f"draft TP {tp} rows {rows}", bodies, expected)
            saved = None if times[PICKS[0]] is None else times[PICKS[1]] - times[PICKS[0]]
            floor = timer.floor_us(logits)
            print(
                markdown_row(
                    [str(tp), str(width), str(rows), *(cell(times[name]) for name in PICKS)]
                    + [cell(saved), cell(floor)]
                )
            )
            points.append(dict(tp=tp, width=width, rows=rows, us=times, floor_us=floor))
    return points


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        for name, value in DRY_RUN.items():
            setattr(args, name, value)
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
    timer = Timer(args)
    print(
        f"# Target verify, LM head + greedy pick, TP 1: vocab {args.vocab}, hidden {args.hidden}, "
        f"bf16 head\n\n{timer.where()}\n"
    )
    points, shard_points = verify_table(timer, weight)
    draft_points = draft_table(timer)
    print("\ntokens equal in every row" if timer.status == 0 else "\nTOKENS DIFFER (see above)")
    if args.json:
        write_json(
            args.json,
            dict(
                args=vars(args),
                **timer.floors,
                points=points,
                shard_points=shard_points,
                draft_points=draft_points,
            ),
        )
    return timer.status


if __name__ == "__main__":
    sys.exit(main())
