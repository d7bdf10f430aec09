"""Draft step through SGLang's own TP group: GEMM + gather against GEMM + exchange, per all-reduce route.

The spec's "Draft step (LM head + top-1)" table, measured through SGLang 0.5.23 itself instead of raw
NCCL (``bench_draft_argmax_exchange.py``): for each route of ``support.tp.ROUTES`` (set by
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

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


import torch

from sglang_dsa_mtp.devices import select_device

select_device()  # before any kernel module is imported: on a CPU (--dry-run), Triton's interpreter

from support import argmax_cases as cases  # noqa: E402
from support import tp_routes  # noqa: E402

DRY_RUN = dict(vocab=1001, hidden=64, rows=[1, 3])


class DraftStep(tp_routes.LmHeadArms):
    """One rank's draft step at ``rows`` rows through SGLang's processors: every arm's body."""

    def __init__(self, group, device, lm_head, gather, exchange, rows, hidden):
        super().__init__(group, device, lm_head, gather, exchange, rows, hidden)
        self.positions, self.draft_tokens = cases.pick_state(rows, device)

    def step(self, name):
        """SGLang's draft-decode forward and greedy pick with processor ``name``."""
        from support.deployment import logits_forward, sglang_pick

        output = logits_forward(self.processors[name], self.lm_head, self.hidden, mode="decode")
        return sglang_pick(output, "decode", self.positions, self.draft_tokens)["topk_index"]


def bench_route(rank, world, init_method, args, route, result_file):
    """Rank ``rank``'s measurements on ``route``; rank 0 writes them (max over ranks) as JSON."""

    def measure(group, device, report):
        from sglang_dsa_mtp.integration.vocab_shard_exchange import all_reduce_route
        from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape
        from support.deployment import build_lm_head, logits_processor

        lm_head, gather, _ = build_lm_head(
            args.vocab, args.hidden, dtype=torch.bfloat16, seed=1000, device=device
        )
        exchange = logits_processor(args.vocab)
        engaged = exchange.enable_draft_argmax_exchange(lm_head, max_rows=max(args.rows))
        width = lm_head.num_embeddings_per_partition
        probe = torch.zeros(exchange_shape(max(args.rows), width, world), device=device)
        report["engaged"] = engaged
        report["predicted"] = all_reduce_route(group, probe)[0]
        report.update(tp_routes.floors(lm_head, device))
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
            report["results"][rows] = tp_routes.time_arms(
                bodies, group, device, args.calls, args.replays
            )

    tp_routes.run_route_bench(rank, world, init_method, route, result_file, measure)


def print_route(world, report) -> None:
    if not tp_routes.print_route_head(world, report, kept="the plugin keeps the gather"):
        return
    rows = []
    for count, times in report["results"].items():
        exchange, together = times.get("exchange"), times.get("GEMM + all-reduce")
        apart = None if exchange is None or together is None else exchange - together
        cells = [tp_routes.cell(times.get(arm)) for arm in tp_routes.ARMS]
        change = tp_routes.change_cell(times["gather"], exchange)
        rows.append([str(count), *cells, tp_routes.cell(apart), change])
    header = ["rows", *tp_routes.ARMS, "exchange - (GEMM + all-reduce)", "gather → exchange"]
    tp_routes.print_table(header, rows)


def add_options(parser) -> None:
    tp_routes.add_num_gpu(
        parser,
        one_gpu="1 checks the script on one GPU (SGLang's group of one rank: nothing to exchange "
        "with, so no exchange arm)",
    )
    parser.add_argument(
        "--rows", default="1,2,4,8,16", help="draft rows (batch size x 1), comma-separated"
    )


def build_parser():
    return tp_routes.route_parser(__doc__, add_options, per_graph="calls", dry_run=DRY_RUN)


def main(argv=None) -> int:
    args = tp_routes.parse_route_args(build_parser(), argv, dry_run=DRY_RUN)
    return tp_routes.bench_main(
        args, bench_route, print_route, step="Draft step", per_graph="calls"
    )


if __name__ == "__main__":
    sys.exit(main())
