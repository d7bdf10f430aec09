"""Target verify through SGLang's own TP group: LM head + gather + pick against the target-verify
argmax exchange, per all-reduce route (beyond docs/spec.md).

Measures "Target verify (LM head + pick), TP2, through SGLang's TP group" of docs/results.md: for
each route of ``support.tp.ROUTES`` (set by SGLang's own server args and environment), SGLang builds
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
(gloo) group at a small size (where SGLang is installed), and prints the tables without figures:
CI runs it (``test_bench_verify_argmax_exchange.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


import torch

from sglang_dsa_mtp.devices import select_device

select_device()  # before any kernel module is imported: on a CPU (--dry-run), Triton's interpreter

from support import tp_routes  # noqa: E402

DRY_RUN = dict(vocab=1001, hidden=64, bs=[1, 3])


class VerifyRound(tp_routes.LmHeadArms):
    """One rank's target-verify round at ``rows`` rows through SGLang's processors: every arm."""

    def __init__(self, group, device, lm_head, gather, exchange, rows, hidden, vocab):
        super().__init__(group, device, lm_head, gather, exchange, rows, hidden)
        # Each arm its own logits buffer: the exchange keeps its shard and tokens in its buffer.
        self.logits_buffers = {
            name: torch.empty(rows, vocab, dtype=torch.float32, device=device)
            for name in self.processors
        }

    def forward(self, name):
        from support.deployment import logits_forward

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
        from sglang_dsa_mtp.integration.state import ProcessorState, peek

        verify = peek(self.processors["exchange"], ProcessorState).verify
        return verify.kept_rows(self.forward("exchange").next_token_logits).tokens.view(-1)


def bench_route(rank, world, init_method, args, route, result_file):
    """Rank ``rank``'s measurements on ``route``; rank 0 writes them (max over ranks) as JSON."""

    def measure(group, device, report):
        from sglang.srt.runtime_context import get_schedule, get_spec

        from sglang_dsa_mtp.integration import vocab_shard_exchange as site
        from support.deployment import build_lm_head, logits_processor

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
                exchange, lm_head, site.VERIFY, max_rows=max(rows_of), capture_rows=rows_of
            )
            report["engaged"], report["reason"] = decision.engaged, decision.reason
            report["predicted"] = decision.facts.get("all-reduce")
            report.update(tp_routes.floors(lm_head, device))
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
                times = tp_routes.time_arms(bodies, group, device, args.calls, args.replays)
                report["results"][bs] = dict(rows=rows, times=times)

    tp_routes.run_route_bench(rank, world, init_method, route, result_file, measure)


def print_route(world, report) -> None:
    kept = f"the plugin keeps SGLang's path ({report.get('reason')})"
    if not tp_routes.print_route_head(world, report, kept=kept):
        return
    rows = []
    for bs, result in report["results"].items():
        times = result["times"]
        cells = [tp_routes.cell(times.get(arm)) for arm in tp_routes.ARMS]
        change = tp_routes.change_cell(times["gather"], times.get("exchange"))
        rows.append([str(bs), str(result["rows"]), *cells, change])
    tp_routes.print_table(["bs", "rows", *tp_routes.ARMS, "gather → exchange"], rows)


def add_options(parser) -> None:
    tp_routes.add_num_gpu(
        parser,
        one_gpu="1 runs the TP 1 form on one GPU (no gather, no all-reduce: the exchange's pick "
        "against SGLang's cast + argmax)",
    )
    parser.add_argument("--bs", default="1,4,16,48", help="batch sizes, comma-separated")
    parser.add_argument(
        "--tokens", type=int, default=5, help="verify rows a request (EAGLE 4/1/5: 5)"
    )


def build_parser():
    return tp_routes.route_parser(__doc__, add_options, per_graph="rounds", dry_run=DRY_RUN)


def main(argv=None) -> int:
    args = tp_routes.parse_route_args(build_parser(), argv, dry_run=DRY_RUN)
    return tp_routes.bench_main(
        args,
        bench_route,
        print_route,
        step="Target verify",
        per_graph="rounds",
        sizes=f", {args.tokens} rows a request",
    )


if __name__ == "__main__":
    sys.exit(main())
