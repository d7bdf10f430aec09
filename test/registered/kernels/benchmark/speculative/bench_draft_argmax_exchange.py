"""Draft step (LM head + top-1): logits gather -> partials exchange, per rank inside CUDA graphs.

Reproduces the spec's table "Draft step (LM head + top-1)" on the GPUs at hand: vocab 154880, hidden
6144, rows 1 / 2 / 4 / 8 / 16, a real TP group (one process per GPU, torch.distributed NCCL), each
rank with its own bf16 LM-head weight shard (SGLang's padded ``ParallelLMHead`` shard). Every figure is
microseconds per call, the maximum over ranks of each rank's median CUDA-graph replay (``--calls``
calls captured back to back in one graph, ``--replays`` timed rounds). Every arm of a row count is
captured first; each round then replays every arm once, in turn, so that clock and power drift
(the 220 us GEMM moves by several us over a run) reach all arms alike. Before each timed replay the
ranks meet on the GPU (a sleep kernel, then a one-element NCCL all-reduce, both outside the timed
events), so that no rank's time includes waiting for another rank's host to launch.

Arms, per rank:

* ``gemm``: the LM-head GEMM alone, ``hidden [rows, 6144] @ weight_shard.T`` in bf16.
* ``all-reduce``: the sum all-reduce of the exchange buffer alone (fp32 ``[rows, tp * splits * 4]``).
* ``gather``: SGLang 0.5.23's gathered path: GEMM + all-gather of the bf16 logits along the vocab
  (``GroupCoordinator.all_gather(dim=-1)``: NCCL ``all_gather_into_tensor`` + the reorder copy) +
  ``[:, :vocab]`` to fp32 + SGLang's own ``draft_topk1_postprocess`` (loaded from its file).
* ``gather fp32``: the same with the logits converted to fp32 before the all-gather (as with an fp32
  LM head), for comparison with ``docs/baselines.md``.
* ``exchange``: GEMM + ``draft_argmax_partials`` + the sum all-reduce + ``draft_argmax_finalize``
  (positions advanced, the draft-token column written, as in draft decode).
* ``GEMM + all-reduce``: the exchange without our kernels: the GEMM, then the all-reduce of an
  exchange-sized buffer, in one graph.
* ``partials + finalize``: our two kernels alone (no GEMM, no communication).

The all-reduce runs on NCCL (``torch.distributed.all_reduce``) and, where torch can set it up, on
torch symmetric memory's one-shot all-reduce (P2P, no multicast): ``--comm nccl,symm_mem``. The
spec's target: ``exchange`` within 5 us of the GEMM plus the all-reduce measured without our kernels,
at every row count. The verdict reads it against the ``GEMM + all-reduce`` arm (one graph, one
median); the table also prints ``exchange - (GEMM + AR)`` from the two arms timed apart, which adds
the spread of two more medians (the all-reduce alone is the noisiest arm). Before timing, every rank checks that the exchange picks the gathered path's tokens.

    python test/registered/kernels/benchmark/speculative/bench_draft_argmax_exchange.py --num-gpu 2
    torchrun --nproc-per-node 4 test/registered/kernels/benchmark/speculative/bench_draft_argmax_exchange.py
    # --json FILE for every measurement; --split-n 2048,4096,8192 sweeps the partials' split width
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import json
import os
import traceback

import torch
import torch.distributed as dist
import triton

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support import argmax_cases as cases
from support import tp
from support.bench_cli import (
    benchmark_parser,
    markdown_header,
    markdown_row,
    parse_list,
    tunables,
)
from support.reference import topk1_module
from support.timing import capture_graph

COMMS = ("nccl", "symm_mem")
TARGET_US = 5.0


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--num-gpu",
        type=int,
        default=None,
        help="TP size, one process per GPU (default: all visible GPUs; under torchrun: its world)",
    )
    parser.add_argument(
        "--rows", default="1,2,4,8,16", help="draft rows (batch size x 1), comma-separated"
    )
    parser.add_argument("--vocab", type=int, default=cases.VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=cases.HIDDEN, help="hidden size")
    parser.add_argument(
        "--comm",
        default=",".join(COMMS),
        help=f"all-reduces to time, comma-separated: nccl, optionally with {COMMS[1]}",
    )
    parser.add_argument(
        "--split-n",
        default=str(dap.SPLIT_N),
        help="partials split width(s), comma-separated; the first one is the headline exchange",
    )
    parser.add_argument(
        "--calls", type=int, default=10, help="calls captured back to back in one CUDA graph"
    )
    parser.add_argument(
        "--replays", type=int, default=30, help="timed rounds; each figure is their median"
    )
    parser.add_argument("--json", help="write every measurement to this file (rank 0)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.rows = parse_list(args.rows)
    args.split_n = parse_list(args.split_n)
    args.comm = args.comm.split(",")
    if not set(args.comm) <= set(COMMS) or "nccl" not in args.comm:
        raise SystemExit(f"--comm takes nccl plus optionally symm_mem, got {args.comm}")
    return args


def capture_calls(body, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``body`` (warmed up eagerly first), replayed once untimed."""
    graph, _ = capture_graph(
        lambda: [body() for _ in range(calls)], capture_error_mode="thread_local"
    )
    graph.replay()
    torch.cuda.synchronize()
    return graph


class Step:
    """One rank's draft step at ``rows`` rows: every arm's body, over shared persistent state."""

    def __init__(self, args, rank, world, weight, rows, comms):
        self.rank, self.world, self.vocab = rank, world, args.vocab
        self.weight, self.rows = weight, rows
        self.width = weight.shape[0]
        gen = torch.Generator().manual_seed(rows)
        self.hidden = torch.randn(rows, args.hidden, generator=gen).to(torch.bfloat16).cuda()
        self.positions, self.draft_tokens = cases.pick_state(rows, "cuda")
        self.postprocess = topk1_module().draft_topk1_postprocess
        self.comms = comms  # name -> (buffer_for, all_reduce)

    def gemm(self):
        return torch.matmul(self.hidden, self.weight.T)

    def gather(self, fp32=False):
        logits = self.gemm()
        if fp32:
            logits = logits.float()
        gathered = tp.all_gather_last_dim(logits)[:, : self.vocab]
        if not fp32:
            gathered = gathered.float()  # SGLang's cast into its fp32 logits buffer
        return self.postprocess(gathered, self.positions, self.draft_tokens, 1)

    def exchange_shape(self):
        return dap.exchange_shape(self.rows, self.width, self.world)

    def all_reduce(self, comm):
        buffer_for, all_reduce = self.comms[comm]
        return all_reduce(buffer_for(self.exchange_shape()))

    def gemm_and_all_reduce(self, comm):
        """The exchange without our kernels: the GEMM, then the all-reduce of an exchange-sized
        buffer."""
        self.gemm()
        return self.all_reduce(comm)

    def kernels_body(self):
        """Our two kernels alone: partials of fixed logits, finalize of a fixed reduced buffer."""
        logits = self.gemm()
        out = torch.empty(self.exchange_shape(), device="cuda")
        reduced = self.all_reduce_of(self.partials(logits, out), "nccl").clone()

        def body():
            self.partials(logits, out)
            return dap.draft_argmax_finalize(reduced, self.positions, self.draft_tokens, 1)

        return body

    def partials(self, logits, out):
        return dap.draft_argmax_partials(
            logits, tp_rank=self.rank, tp_size=self.world, vocab_size=self.vocab, out=out
        )

    def all_reduce_of(self, exchange, comm):
        return self.comms[comm][1](exchange)

    def exchange(self, comm):
        buffer_for, all_reduce = self.comms[comm]
        exchange = self.partials(self.gemm(), buffer_for(self.exchange_shape()))
        reduced = all_reduce(exchange)
        return dap.draft_argmax_finalize(reduced, self.positions, self.draft_tokens, 1)


def check_tokens(step: Step, comm: str) -> None:
    """Eager, before timing: the exchange picks the gathered path's tokens (both NaN policies)."""
    positions, tokens = step.positions.clone(), step.draft_tokens.clone()
    _, ours = step.exchange(comm)
    _, gathered = step.gather()
    step.positions.copy_(positions)
    step.draft_tokens.copy_(tokens)
    if not torch.equal(ours, gathered):
        raise AssertionError(f"rank {step.rank}, rows {step.rows}, {comm}: tokens differ")


def bench_rank(rank: int, world: int, args) -> dict:
    """Every measurement of this rank, reduced to the max over ranks (identical on every rank)."""
    width = cases.padded_shard_width(args.vocab, world)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    weight = (torch.randn(width, args.hidden, generator=gen, device="cuda") * 0.02).to(
        torch.bfloat16
    )
    most = max(args.rows) * world * triton.cdiv(width, min(args.split_n)) * dap.LANES
    comms, unavailable = {}, {}
    for comm in args.comm:
        try:
            comms[comm] = tp.make_all_reduce(comm, most, torch.device("cuda", rank))
        except tp.ArmUnavailable as exc:
            unavailable[comm] = str(exc)
    results = {}
    for rows in args.rows:
        step = Step(args, rank, world, weight, rows, comms)
        graphs = {
            "gemm": capture_calls(step.gemm, args.calls),
            "gather": capture_calls(step.gather, args.calls),
            "gather fp32": capture_calls(lambda: step.gather(fp32=True), args.calls),
        }
        for i, split_n in enumerate(args.split_n):
            with tunables(dap, {"SPLIT_N": split_n}):
                suffix = "" if i == 0 else f" split={split_n}"
                for comm in comms:
                    label = "" if comm == "nccl" else " symm"
                    check_tokens(step, comm)
                    graphs[f"all-reduce{label}{suffix}"] = capture_calls(
                        lambda c=comm: step.all_reduce(c), args.calls
                    )
                    graphs[f"GEMM + all-reduce{label}{suffix}"] = capture_calls(
                        lambda c=comm: step.gemm_and_all_reduce(c), args.calls
                    )
                    graphs[f"exchange{label}{suffix}"] = capture_calls(
                        lambda c=comm: step.exchange(c), args.calls
                    )
                graphs[f"partials + finalize{suffix}"] = capture_calls(
                    step.kernels_body(), args.calls
                )
        row = tp.interleaved_times_us(graphs, args.calls, args.replays)
        results[rows] = {name: tp.max_over_ranks(value) for name, value in row.items()}
        del graphs
    return {"shard_width": width, "results": results, "unavailable": unavailable}


def print_tables(args, world, report) -> None:
    results, width = report["results"], report["shard_width"]
    props = torch.cuda.get_device_properties(0)
    print(
        f"# {world} x {props.name}, torch {torch.__version__}, triton {triton.__version__}; "
        f"TP{world}, vocab {args.vocab} (shard {width}), hidden {args.hidden}, bf16 LM head; "
        f"split {args.split_n[0]} ({dap.splits_per_rank(width)} per rank at the default); "
        f"{args.calls} calls per graph, median of {args.replays} replays, max over ranks; us"
    )
    for comm, why in report["unavailable"].items():
        print(f"# {comm}: unavailable, {why}")
    comms = [c for c in args.comm if c not in report["unavailable"]]
    header = ["rows", "GEMM", "gather", "gather fp32"]
    for comm in comms:
        label = "" if comm == "nccl" else " symm"
        header += [f"all-reduce{label}", f"GEMM + all-reduce{label}", f"exchange{label}"]
        header += [f"exchange{label} - (GEMM + AR)", f"exchange{label} - GEMM+AR arm"]
    header += ["partials + finalize"]
    extra = sorted({k for r in results.values() for k in r if "split=" in k})
    header += extra
    print(markdown_header(header))
    for rows, r in results.items():
        cells = [str(rows), *(f"{r[k]:.1f}" for k in ("gemm", "gather", "gather fp32"))]
        for comm in comms:
            label = "" if comm == "nccl" else " symm"
            apart = r[f"exchange{label}"] - r["gemm"] - r[f"all-reduce{label}"]
            together = r[f"exchange{label}"] - r[f"GEMM + all-reduce{label}"]
            cells += [f"{r[f'all-reduce{label}']:.1f}", f"{r[f'GEMM + all-reduce{label}']:.1f}"]
            cells += [f"{r[f'exchange{label}']:.1f}", f"{apart:+.1f}", f"{together:+.1f}"]
        cells += [f"{r['partials + finalize']:.1f}"] + [f"{r[k]:.1f}" for k in extra]
        print(markdown_row(cells))
    print()
    print("Spec format (gather -> exchange):\n")
    print(markdown_header(["rows", *(str(rows) for rows in results)]))
    for comm in comms:
        label = "" if comm == "nccl" else " symm"
        name = {"nccl": "NCCL", "symm_mem": "symm-mem one-shot"}[comm]
        cells = [f"{r['gather']:.1f} → {r[f'exchange{label}']:.1f}" for r in results.values()]
        print(markdown_row([f"TP{world} ({name} all-reduce)", *cells]))
    print()
    for comm in comms:
        label = "" if comm == "nccl" else " symm"
        missed = [
            rows
            for rows, r in results.items()
            if r[f"exchange{label}"] - r[f"GEMM + all-reduce{label}"] > TARGET_US
        ]
        verdict = "met at every row count" if not missed else f"MISSED at rows {missed}"
        print(
            f"target ({comm}): exchange within {TARGET_US:.0f} us of the GEMM + all-reduce arm: "
            f"{verdict}"
        )


def run(rank: int, world: int, args) -> None:
    try:
        report = bench_rank(rank, world, args)
        if rank == 0:
            print_tables(args, world, report)
            if args.json:
                settings = {**vars(args), "json": os.path.basename(args.json)}
                with open(args.json, "w") as f:
                    json.dump({"tp": world, "args": settings, **report}, f, indent=1)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawned(rank: int, world: int, init_method: str, args) -> None:
    tp.init_tp_group(rank, world, init_method)
    run(rank, world, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_draft_argmax_exchange needs CUDA GPUs", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        run(rank, world, args)
        return 0
    world = tp.tp_size(args.num_gpu)
    if world is None:
        return 2
    tp.run_group(spawned, world, args, timeout_s=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
