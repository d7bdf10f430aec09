"""Target verify through SGLang's own TP group: LM head + gather + pick against the target-verify
argmax exchange, per all-reduce route (beyond docs/spec.md).

Measures "Target verify (LM head + pick), TP2, through SGLang's TP group" of docs/results.md: for
each route of ``testing.tp.ROUTES`` (set by SGLang's own server args and environment), SGLang builds
its real TP group and device communicators in one process per GPU, the plugin's hooks are applied
by SGLang's ``HookRegistry``, and each arm is SGLang's target ``LogitsProcessor`` forward in target
verify, captured as SGLang's graph runners capture (inside ``graph_capture()``, ``--calls`` rounds
per graph). Vocab 154880, hidden 6144, a bf16 ``ParallelLMHead``, EAGLE 4/1/5 (5 rows a request),
bs 1 / 4 / 16 / 48. Every figure is microseconds per round, the maximum over ranks of each rank's
median replay; each round replays every arm once, in turn, the ranks meeting on the GPU before each
timed replay.

Arms, per rank:

* ``GEMM``: the processor's LM-head GEMM alone (``LogitsProcessor._compute_lm_head``).
* ``gather``: SGLang's target verify: ``LogitsProcessor.forward`` (GEMM, SGLang's logits all-gather,
  its cast into the fp32 logits buffer) + ``torch.argmax`` of the logits (the greedy verify's pick).
* ``all-reduce``: ``get_parallel().tp_group.all_reduce`` of the fp32 exchange buffer, on the route.
* ``GEMM + all-reduce``: both, one graph (the exchange without our kernels).
* ``exchange``: the same forward with the target-verify exchange engaged (GEMM, partials, the
  all-reduce, the finalize: the argmax is in the graph); only where the plugin engages (not NCCL;
  at TP 1 without an all-reduce).

Before timing, every rank checks that the exchange picks the gather's tokens. The header of each
route's table names the communicators SGLang built, the route the plugin predicted for the exchange
buffer, the launch floor and the GEMM's floor (its weight shard's bytes over the copy bandwidth).

Needs SGLang's Python dependencies (``source test/gpu_sglang_env.sh``):

    python3 test/registered/kernels/benchmark/speculative/bench_verify_argmax_exchange_sglang.py
    # --num-gpu 1 checks the script on one GPU; --routes custom-ar-v2,pynccl; --json FILE

``--dry-run`` runs the same arms once (one round each), eagerly and untimed, in a two-process CPU
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

DRY_RUN = dict(vocab=1001, hidden=64, bs=[1, 3])
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
        help="TP size, one process per GPU (default: every visible GPU); 1 runs the TP 1 form on "
        "one GPU (no gather, no all-reduce: the exchange's pick against SGLang's cast + argmax)",
    )
    parser.add_argument("--bs", default="1,4,16,48", help="batch sizes, comma-separated")
    parser.add_argument(
        "--tokens", type=int, default=5, help="verify rows a request (EAGLE 4/1/5: 5)"
    )
    parser.add_argument("--vocab", type=int, default=cases.VOCAB, help="vocabulary size")
    parser.add_argument("--hidden", type=int, default=cases.HIDDEN, help="hidden size")
    parser.add_argument(
        "--calls", type=int, default=10, help="rounds captured back to back in one CUDA graph"
    )
    parser.add_argument(
        "--replays", type=int, default=30, help="timed rounds; each figure is their median"
    )
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the arms once, eagerly and untimed, in a 2-process CPU (gloo) group at vocab "
        f"{DRY_RUN['vocab']}, hidden {DRY_RUN['hidden']}, bs {DRY_RUN['bs']}",
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.bs = parse_list(args.bs)
    args.routes = args.routes.split(",")
    unknown = set(args.routes) - set(tp.ROUTES)
    if unknown:
        raise SystemExit(f"--routes takes any of {list(tp.ROUTES)}, got {sorted(unknown)}")
    if args.dry_run:
        args.vocab, args.hidden, args.bs = DRY_RUN["vocab"], DRY_RUN["hidden"], DRY_RUN["bs"]
        args.calls = 1
        args.routes = [tp.CPU_ROUTE]
    return args


class VerifyRound:
    """One rank's target-verify round at ``rows`` rows through SGLang's processors: every arm."""

    def __init__(self, group, device, lm_head, gather, exchange, rows, hidden, vocab):
        from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape

        self.group, self.lm_head = group, lm_head
        self.processors = dict(gather=gather, exchange=exchange)
        gen = torch.Generator().manual_seed(rows)
        self.hidden = torch.randn(rows, hidden, generator=gen).to(lm_head.weight.dtype).to(device)
        # Each arm its own logits buffer: the exchange keeps its shard and tokens in its buffer.
        self.logits_buffers = {
            name: torch.empty(rows, vocab, dtype=torch.float32, device=device)
            for name in self.processors
        }
        shape = exchange_shape(rows, lm_head.num_embeddings_per_partition, group.world_size)
        self.buffer = torch.zeros(shape, dtype=torch.float32, device=device)

    def gemm(self):
        return self.processors["gather"]._compute_lm_head(self.hidden, self.lm_head, None)

    def all_reduce(self):
        return self.group.all_reduce(self.buffer)

    def gemm_and_all_reduce(self):
        self.gemm()
        return self.all_reduce()

    def forward(self, name):
        from sglang_dsa_mtp.testing.deployment import logits_forward

        return logits_forward(
            self.processors[name],
            self.lm_head,
            self.hidden,
            mode="target_verify",
            logits_buffer=self.logits_buffers[name],
        )

    def gather_pick(self):
        """SGLang's target verify and its greedy pick: the argmax of the gathered fp32 logits."""
        return torch.argmax(self.forward("gather").next_token_logits, dim=-1)

    def exchange_pick(self):
        """The exchange's target verify: the argmax the graph's finalize picked."""
        from sglang_dsa_mtp.integration.vocab_shard_exchange import kept_shard_of

        shard = self.forward("exchange").next_token_logits
        kept, start = kept_shard_of(shard)
        return kept.tokens[start : start + shard.shape[0]].view(-1)


def bench_route(rank, world, init_method, args, route, result_file):
    """Rank ``rank``'s measurements on ``route``; rank 0 writes them (max over ranks) as JSON."""
    report = dict(route=route, results={})
    try:
        with tp.route_group(rank, world, init_method, route) as (group, device):
            from sglang.srt.plugins.hook_registry import HookRegistry
            from sglang.srt.runtime_context import get_schedule, get_spec

            from sglang_dsa_mtp import plugin
            from sglang_dsa_mtp.integration import verify_argmax_exchange as site
            from sglang_dsa_mtp.testing.deployment import build_lm_head, logits_processor

            plugin.register()
            HookRegistry.apply_hooks()
            report["communicators"] = tp.describe_communicators(group)
            eagle = dict(
                speculative_algorithm="EAGLE",
                speculative_num_steps=args.tokens - 1,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=args.tokens,
            )
            with (
                get_spec().override(**eagle),
                get_schedule().override(max_running_requests=max(args.bs)),
            ):
                lm_head, gather, _ = build_lm_head(
                    args.vocab, args.hidden, dtype=torch.bfloat16, seed=1000, device=device
                )
                exchange = logits_processor(args.vocab)
                rows_of = [bs * args.tokens for bs in args.bs]
                decision = site.opt_in(
                    exchange, lm_head, max_rows=max(rows_of), capture_rows=rows_of
                )
                report["engaged"], report["reason"] = decision.engaged, decision.reason
                report["predicted"] = decision.facts.get("all-reduce")
                if device.type == "cuda":
                    from sglang_dsa_mtp.testing.timing import (
                        copy_bandwidth_bytes_per_us,
                        launch_floor_us,
                    )

                    report["launch_floor_us"] = launch_floor_us()
                    weight_bytes = lm_head.weight.numel() * lm_head.weight.element_size()
                    report["gemm_floor_us"] = weight_bytes / copy_bandwidth_bytes_per_us()
                for bs, rows in zip(args.bs, rows_of):
                    step = VerifyRound(
                        group, device, lm_head, gather, exchange, rows, args.hidden, args.vocab
                    )
                    if decision.engaged:
                        ours, theirs = step.exchange_pick(), step.gather_pick()
                        if not torch.equal(ours, theirs):
                            raise AssertionError(f"rank {rank}, {route}, bs {bs}: tokens differ")
                    bodies = {"GEMM": step.gemm, "gather": step.gather_pick}
                    if world > 1:
                        bodies["all-reduce"] = step.all_reduce
                        bodies["GEMM + all-reduce"] = step.gemm_and_all_reduce
                    if decision.engaged:
                        bodies["exchange"] = step.exchange_pick
                    graphs = {
                        name: SimpleNamespace(
                            replay=tp.capture_replayer(
                                lambda body=body: [body() for _ in range(args.calls)],
                                group,
                                device,
                            )
                        )
                        for name, body in bodies.items()
                    }
                    if device.type == "cuda":
                        times = tp.interleaved_times_us(graphs, args.calls, args.replays)
                        times = {name: tp.max_over_ranks(t) for name, t in times.items()}
                    else:
                        times = {name: None for name in graphs}
                    report["results"][bs] = dict(rows=rows, times=times)
    except tp.RouteUnavailable as exc:
        report["unavailable"] = str(exc)
    except Exception:
        traceback.print_exc()
        raise
    if rank == 0:
        Path(result_file).write_text(json.dumps(report))


def cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_route(world, report) -> None:
    route = report["route"]
    flags = tp.ROUTES[route].flags if route in tp.ROUTES else "CPU, gloo"
    if "unavailable" in report:
        print(f"## {route} ({flags}): not run, {report['unavailable']}\n")
        return
    built = ", ".join(f"{k} {v}" for k, v in report["communicators"].items() if v)
    engaged = (
        "the exchange engages"
        if report["engaged"]
        else f"the plugin keeps SGLang's path ({report['reason']})"
    )
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
    print(markdown_header(["bs", "rows", *ARMS, "gather → exchange"]))
    for bs, result in report["results"].items():
        times = result["times"]
        exchange, gather = times.get("exchange"), times["gather"]
        change = "-" if exchange is None or gather is None else f"{gather:.1f} → {exchange:.1f}"
        values = [cell(times.get(arm)) for arm in ARMS]
        print(markdown_row([str(bs), str(result["rows"]), *values, change]))
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
        else f"{args.calls} rounds per graph, median of {args.replays} replays, max over ranks; us"
    )
    print(
        f"# Target verify through SGLang's TP group: vocab {args.vocab} "
        f"(shard {cases.padded_shard_width(args.vocab, world)}), hidden {args.hidden}, bf16 LM head, "
        f"{args.tokens} rows a request; {timing}\n"
    )
    for report in reports:
        print_route(world, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp": world, "args": vars(args), "routes": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
