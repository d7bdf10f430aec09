"""Draft step through SGLang's own TP group: GEMM + gather against GEMM + exchange, per all-reduce route.

The spec's "Draft step (LM head + top-1)" table, measured through SGLang 0.5.23 itself instead of raw
NCCL (``bench_draft_argmax_exchange.py``): for each route of ``testing.tp.ROUTES`` (set by
SGLang's own server args and environment), SGLang builds its real TP group and device communicators
in one process per GPU, the plugin's hooks are applied by SGLang's ``HookRegistry``, and each arm is
SGLang's own code, captured as SGLang's draft-decode runner captures (inside ``graph_capture()``,
``--calls`` calls per graph). Vocab 154880, hidden 6144, a bf16 ``ParallelLMHead``, rows 1 / 2 / 4 /
8 / 16. Every figure is microseconds per call, the maximum over ranks of each rank's median replay;
each round replays every arm once, in turn, the ranks meeting on the GPU before each timed replay.

Arms, per rank:

* ``GEMM``: the processor's LM-head GEMM alone (``LogitsProcessor._compute_lm_head``).
* ``gather``: SGLang's draft-decode step: ``LogitsProcessor.forward`` (GEMM, SGLang's logits
  all-gather, the fp32 logits) + ``draft_topk1_postprocess``.
* ``all-reduce``: ``get_parallel().tp_group.all_reduce`` of the fp32 exchange buffer, on the route.
* ``GEMM + all-reduce``: both, one graph (the exchange without our kernels).
* ``exchange``: the same forward with the exchange engaged (GEMM, partials, the all-reduce) + the
  draft-decode pick from the partials; only on the routes where the plugin engages (not NCCL).

Before timing, every rank checks that the exchange picks the gather's tokens. The header of each
route's table names the communicators SGLang built, the route the plugin predicted for the exchange
buffer, the launch floor (a one-element kernel per call in a graph) and the GEMM's floor (its weight
shard's bytes over the device-to-device copy bandwidth).

Needs SGLang's Python dependencies (``source test/gpu_sglang_env.sh``) and two or more GPUs:

    python3 test/registered/kernels/benchmark/speculative/bench_draft_argmax_exchange_sglang.py
    # --routes custom-ar-v2,pynccl; --json FILE for every measurement

``--dry-run`` runs the same arms once (one call each), eagerly and untimed, in a two-process CPU
(gloo) group at a small size (where SGLang is installed), and prints the tables without figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from sglang_dsa_mtp.devices import select_device

select_device()  # before any kernel module is imported: on a CPU (--dry-run), Triton's interpreter

from sglang_dsa_mtp.testing import argmax_cases as cases  # noqa: E402
from sglang_dsa_mtp.testing import tp  # noqa: E402
from sglang_dsa_mtp.testing.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    parse_list,
)

DRY_RUN = dict(vocab=1001, hidden=64, rows=[1, 3])
ARMS = ("GEMM", "gather", "all-reduce", "GEMM + all-reduce", "exchange")


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--routes",
        default=",".join(tp.GPU_ROUTES),
        help="all-reduce routes (testing.tp.ROUTES), comma-separated; one table each",
    )
    parser.add_argument(
        "--num-gpu",
        type=int,
        default=None,
        help="TP size, one process per GPU (default: every visible GPU); 1 checks the script on "
        "one GPU (SGLang's group of one rank: nothing to exchange with, so no exchange arm)",
    )
    parser.add_argument(
        "--rows", default="1,2,4,8,16", help="draft rows (batch size x 1), comma-separated"
    )
    parser.add_argument("--vocab", type=int, default=cases.VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=cases.HIDDEN, help="hidden size")
    parser.add_argument(
        "--calls", type=int, default=10, help="calls captured back to back in one CUDA graph"
    )
    parser.add_argument(
        "--replays", type=int, default=30, help="timed rounds; each figure is their median"
    )
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the arms once, eagerly and untimed, in a 2-process CPU (gloo) group at vocab "
        f"{DRY_RUN['vocab']}, hidden {DRY_RUN['hidden']}, rows {DRY_RUN['rows']}",
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.rows = parse_list(args.rows)
    args.routes = args.routes.split(",")
    unknown = set(args.routes) - set(tp.ROUTES)
    if unknown:
        raise SystemExit(f"--routes takes any of {list(tp.ROUTES)}, got {sorted(unknown)}")
    if args.dry_run:
        args.vocab, args.hidden, args.rows = DRY_RUN["vocab"], DRY_RUN["hidden"], DRY_RUN["rows"]
        args.calls = 1
        args.routes = [tp.CPU_ROUTE]
    return args


class DraftStep:
    """One rank's draft step at ``rows`` rows through SGLang's processors: every arm's body."""

    def __init__(self, group, device, lm_head, gather, exchange, rows, hidden):
        from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape

        self.group, self.lm_head = group, lm_head
        self.processors = dict(gather=gather, exchange=exchange)
        gen = torch.Generator().manual_seed(rows)
        self.hidden = torch.randn(rows, hidden, generator=gen).to(lm_head.weight.dtype).to(device)
        self.positions, self.draft_tokens = cases.pick_state(rows, device)
        shape = exchange_shape(rows, lm_head.num_embeddings_per_partition, group.world_size)
        self.buffer = torch.zeros(shape, dtype=torch.float32, device=device)

    def gemm(self):
        return self.processors["gather"]._compute_lm_head(self.hidden, self.lm_head, None)

    def all_reduce(self):
        return self.group.all_reduce(self.buffer)

    def gemm_and_all_reduce(self):
        self.gemm()
        return self.all_reduce()

    def step(self, name):
        """SGLang's draft-decode forward and greedy pick with processor ``name``."""
        from sglang_dsa_mtp.testing.deployment import logits_forward, sglang_pick

        output = logits_forward(self.processors[name], self.lm_head, self.hidden, mode="decode")
        return sglang_pick(output, "decode", self.positions, self.draft_tokens)["topk_index"]


def bench_route(rank, world, init_method, args, route, result_file):
    """Rank ``rank``'s measurements on ``route``; rank 0 writes them (max over ranks) as JSON."""
    report = dict(route=route, results={})
    try:
        with tp.route_group(rank, world, init_method, route) as (group, device):
            from sglang.srt.plugins.hook_registry import HookRegistry

            from sglang_dsa_mtp import plugin
            from sglang_dsa_mtp.integration.tp_all_reduce import all_reduce_route
            from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape
            from sglang_dsa_mtp.testing.deployment import build_lm_head, logits_processor

            plugin.register()
            HookRegistry.apply_hooks()
            report["communicators"] = tp.describe_communicators(group)
            lm_head, gather, _ = build_lm_head(
                args.vocab, args.hidden, dtype=torch.bfloat16, seed=1000, device=device
            )
            exchange = logits_processor(args.vocab)
            engaged = exchange.enable_draft_argmax_exchange(lm_head, max_rows=max(args.rows))
            width = lm_head.num_embeddings_per_partition
            probe = torch.zeros(exchange_shape(max(args.rows), width, world), device=device)
            report["engaged"] = engaged
            report["predicted"] = all_reduce_route(group, probe)[0]
            if device.type == "cuda":
                from sglang_dsa_mtp.testing.timing import (
                    copy_bandwidth_bytes_per_us,
                    launch_floor_us,
                )

                report["launch_floor_us"] = launch_floor_us()
                weight_bytes = lm_head.weight.numel() * lm_head.weight.element_size()
                report["gemm_floor_us"] = weight_bytes / copy_bandwidth_bytes_per_us()
            for rows in args.rows:
                step = DraftStep(group, device, lm_head, gather, exchange, rows, args.hidden)
                if engaged:
                    ours, theirs = step.step("exchange"), step.step("gather")
                    if not torch.equal(ours, theirs):
                        raise AssertionError(f"rank {rank}, {route}, rows {rows}: tokens differ")
                bodies = {
                    "GEMM": step.gemm,
                    "gather": lambda step=step: step.step("gather"),
                    "all-reduce": step.all_reduce,
                    "GEMM + all-reduce": step.gemm_and_all_reduce,
                }
                if engaged:
                    bodies["exchange"] = lambda step=step: step.step("exchange")
                graphs = {
                    name: SimpleNamespace(
                        replay=tp.capture_replayer(
                            lambda body=body: [body() for _ in range(args.calls)], group, device
                        )
                    )
                    for name, body in bodies.items()
                }
                if device.type == "cuda":
                    times = tp.interleaved_times_us(graphs, args.calls, args.replays)
                    times = {name: tp.max_over_ranks(t) for name, t in times.items()}
                else:
                    times = {name: None for name in graphs}
                report["results"][rows] = times
    except tp.RouteUnavailable as exc:
        report["unavailable"] = str(exc)
    except Exception:
        traceback.print_exc()
        raise
    if rank == 0:
        Path(result_file).write_text(json.dumps(report))


def cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_route(args, world, report) -> None:
    route = report["route"]
    flags = tp.ROUTES[route].flags if route in tp.ROUTES else "CPU, gloo"
    if "unavailable" in report:
        print(f"## {route} ({flags}): not run, {report['unavailable']}\n")
        return
    built = ", ".join(f"{k} {v}" for k, v in report["communicators"].items() if v)
    engaged = "the exchange engages" if report["engaged"] else "the plugin keeps the gather"
    print(f"## {route} ({flags})\n")
    print(f"TP{world}; SGLang built: {built or 'no device communicator'}")
    print(f"the exchange buffer's all-reduce in a graph: {report['predicted']}; {engaged}")
    if "launch_floor_us" in report:
        print(
            f"floors: launch {report['launch_floor_us']:.1f} us per call; GEMM (weight shard bytes "
            f"/ copy bandwidth) {report['gemm_floor_us']:.1f} us"
        )
    else:
        print(
            "dry run: each arm ran once, eagerly, untimed; where engaged, the exchange picked the "
            "gather's tokens"
        )
    print()
    header = ["rows", *ARMS, "exchange - (GEMM + all-reduce)", "gather → exchange"]
    print(markdown_header(header))
    for rows, times in report["results"].items():
        values = [times.get(arm) for arm in ARMS]
        exchange, together, gather = (
            times.get("exchange"),
            times.get("GEMM + all-reduce"),
            times["gather"],
        )
        apart = None if exchange is None or together is None else exchange - together
        change = "-" if exchange is None or gather is None else f"{gather:.1f} → {exchange:.1f}"
        print(markdown_row([str(rows), *(cell(v) for v in values), cell(apart), change]))
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        world = 2
    else:
        if not torch.cuda.is_available():
            print("this benchmark needs CUDA GPUs (or --dry-run)", file=sys.stderr)
            return 2
        world = tp.tp_size(args.num_gpu, least=1)
        if world is None:
            return 2
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for route in args.routes:
            result_file = str(Path(tmp, f"{route}.json"))
            tp.run_group(bench_route, world, args, route, result_file, timeout_s=1800)
            reports.append(json.loads(Path(result_file).read_text()))
    timing = (
        "dry run"
        if args.dry_run
        else (f"{args.calls} calls per graph, median of {args.replays} replays, max over ranks; us")
    )
    print(
        f"# Draft step through SGLang's TP group: vocab {args.vocab} "
        f"(shard {cases.padded_shard_width(args.vocab, world)}), hidden {args.hidden}, bf16 LM head; "
        f"{timing}\n"
    )
    for report in reports:
        print_route(args, world, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp": world, "args": vars(args), "routes": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
