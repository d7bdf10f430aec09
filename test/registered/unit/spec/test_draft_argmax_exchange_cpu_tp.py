"""The draft argmax exchange in a real two-process TP group, on CPU (gloo), with SGLang's real
``LogitsProcessor`` and vocab-parallel ``ParallelLMHead`` and the plugin's hooks applied by SGLang's
``HookRegistry`` in each process; kernels under Triton's interpreter.

This is the part of the TP test that needs SGLang's runtime (absent where the GPU tests run from the wheel's files):
the exchange off gathers logits bit-identical to the per-shard reference, the opt-in engages on
the group's CPU all-reduce, and the exchange on gives the same tokens, ``topk_p``, positions and
draft tokens as SGLang's pick from the gathered logits (draft decode and draft extend), for plain
heads and for a ModelOpt NVFP4 checkpoint's NextN draft head sharing the target's bf16 weight. The GPU
side (NCCL and symmetric-memory all-reduce, CUDA graphs) is
``kernels/ops/speculative/test_draft_argmax_exchange_tp.py``. The body of each process is
:func:`exchange_on_off_worker`, here (spawned by ``support.tp.run_group``, which pickles it by this
module's name); the heads and their logits path are ``support.deployment``'s.
"""

import contextlib
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from support.deployment import (
    bits_differ,
    build_draft_worker,
    build_lm_head,
    build_shared_draft_head,
    logits_forward,
    reference_logits,
    sglang_pick,
)
from support.tp import read_reports, run_group, sglang_tp_group, shared_hidden

WORLD = 2
# The quantized checkpoint the TP test deploys: the spec's model's kind, ModelOpt NVFP4, whose NextN
# draft head keeps ModelOptFp4LinearMethod and takes the target's bf16 weight.
QUANTIZED_CHECKPOINT = "modelopt_fp4"
OTHER_RANK = "another TP rank keeps the gather (its reason is in its log)"
# What each rank agrees on when only rank 1 objects ("only rank 1 objects"): its own reason there,
# on the other rank the word that another rank keeps the gather.
AGREED = {0: OTHER_RANK, 1: "only rank 1 objects"}
# Each rank's opt-in decision when rank 1's opt-in check raises.
REASON_WHEN_RANK_1_FAILS = {
    0: OTHER_RANK,
    1: "the opt-in check raised RuntimeError: rank 1 cannot tell",
}
# What each rank's EAGLE draft worker decides when only rank 1's worker check fails (its topk).
WORKER_REASON_WHEN_RANK_1_FAILS = {
    0: OTHER_RANK,
    1: "--speculative-eagle-topk is 2: drafts need probabilities",
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_logits_processor_exchange_on_and_off_pick_the_same_tokens_in_a_cpu_tp_group(tmp_path):
    run_group(exchange_on_off_worker, WORLD, str(tmp_path), timeout_s=900)
    reports = read_reports(str(tmp_path), WORLD)
    assert [r["rank"] for r in reports] == list(range(WORLD))
    for report in reports:
        where = f"rank {report['rank']}"
        assert report["failures"] == [], where
        assert report["group"] == dict(world_size=WORLD, rank=report["rank"]), where
        assert report["flags"] == dict(
            do_tensor_parallel_all_gather=True,
            use_attn_tp_group=False,
            do_tensor_parallel_all_gather_dp_attn=False,
        ), where
        assert report["shard_width"] == 512, where  # vocab 1001 padded to 1024, two shards
        assert report["route"] == "CPU shared memory or torch.distributed", where
        assert report["agreed"] == AGREED[report["rank"]], f"{where}: rank 1's objection"
        assert report["reason_when_rank_1_fails"] == REASON_WHEN_RANK_1_FAILS[report["rank"]], where
        assert report["engaged_when_rank_1_fails"] is False, where
        reason = WORKER_REASON_WHEN_RANK_1_FAILS[report["rank"]]
        assert report["worker_lines_when_rank_1_fails"] == [
            f"sglang_dsa_mtp: draft_argmax_exchange off: greedy draft keeps the logits gather: "
            f"{reason} (draft model DeepseekV3ForCausalLMNextN, topk {1 + report['rank']}, tp "
            f"size {WORLD})"
        ], f"{where}: rank 1's worker objection"
        assert report["worker_engaged_when_rank_1_fails"] is False, where
        assert report["quantized"] == dict(
            checkpoint="modelopt_fp4",
            quant_method="ModelOptFp4LinearMethod",
            weight_dtype="torch.bfloat16",
        ), f"{where}: the NVFP4 draft head keeps its method and takes the target's bf16 weight"
        # (2 dtypes x 2 logit scales + the NVFP4 draft head) x (decode rows 1..5 + draft extend)
        assert report["checked"] == (2 * 2 + 1) * 6, where
        assert [(a["dtype"], a["sum_ok"]) for a in report["all_reduce"]] == [
            ("torch.float32", True),
            ("torch.bfloat16", True),
        ], where


# --- each rank's body: run_group spawns it, pickled by this module's name ---


@contextlib.contextmanager
def logged_lines(name: str):
    """The messages logger ``name`` logs at INFO and above in the block."""
    lines, logger = [], logging.getLogger(name)

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def exchange_on_off_worker(
    rank: int,
    world: int,
    init_method: str,
    result_dir: str,
    vocab_size: int = 1001,
    hidden: int = 64,
    logit_scale: float = 0.37,
) -> None:
    """Body of the CPU TP test of the draft argmax exchange; writes ``rank<r>.json``.

    In :func:`sglang_tp_group`, with the plugin registered and its hooks applied by SGLang's
    ``HookRegistry``: ``get_parallel().tp_group.all_reduce`` of fp32 and bf16 CPU tensors against the
    sum; the opt-in's cross-rank agreement (a reason on one rank reaches every rank); then for bf16
    and fp32, with and without ``logit_scale``, and for the bf16 draft head of
    :data:`QUANTIZED_CHECKPOINT` (:func:`build_shared_draft_head`):

    * exchange off: the head's shard against the full weight, ``next_token_logits`` of decode (rows
      1..5) and draft extend (8 rows, ``select_index`` [7, 0, 3, 3]) bit for bit against
      :func:`reference_logits`, and SGLang's pick from them;
    * ``enable_draft_argmax_exchange`` engages (route: CPU all-reduce);
    * exchange on: the same forwards return ``next_token_argmax_partials``, and the picks from them
      (tokens, ``topk_p``, positions, draft tokens) equal SGLang's.

    Column 700 (rank 1's shard) repeats column 5's weight and row 0 of every batch points at it:
    a cross-rank tie that the lower column must win. Then rank 1's opt-in check raises: both ranks
    still agree, on keeping the gather (each rank's reason in the report). Last, SGLang's EAGLE
    draft worker (:func:`build_draft_worker`) runs the plugin's hook before capturing its graphs
    (``opt_in_draft_model``) on a platform the gates take for CUDA, rank 1's worker with topk 2:
    every rank keeps the gather, each logging why, and no rank is left in the processor's opt-in
    (a collective) waiting for the other.
    """
    start = time.monotonic()
    report = {"rank": rank, "world": world, "checked": 0, "failures": [], "all_reduce": []}
    failures = report["failures"]
    try:
        with sglang_tp_group(rank, world, init_method) as tp_group:
            from sglang.srt.plugins.hook_registry import HookRegistry
            from sglang.srt.runtime_context import get_parallel

            from sglang_dsa_mtp import plugin
            from sglang_dsa_mtp.integration.state import ProcessorState, peek
            from sglang_dsa_mtp.integration.vocab_shard_exchange import agree_across_group

            plugin.register()
            HookRegistry.apply_hooks()
            report["group"] = dict(world_size=tp_group.world_size, rank=tp_group.rank_in_group)
            report["setup_s"] = round(time.monotonic() - start, 2)
            for dtype in (torch.float32, torch.bfloat16):
                base = torch.arange(1, 13, dtype=torch.float32).view(3, 4) * 0.25
                mine = (base * (rank + 1)).to(dtype)
                out = get_parallel().tp_group.all_reduce(mine)
                want = (base * (world * (world + 1) // 2)).to(dtype)
                report["all_reduce"].append(dict(dtype=str(dtype), sum_ok=torch.equal(out, want)))
            report["agreed"] = agree_across_group(
                tp_group, "only rank 1 objects" if rank == 1 else None
            )

            heads = [
                (dtype, scale, None)
                for dtype in (torch.bfloat16, torch.float32)
                for scale in (None, logit_scale)
            ]
            heads.append((torch.bfloat16, None, QUANTIZED_CHECKPOINT))
            for dtype, scale, checkpoint in heads:
                where = f"{dtype}, logit_scale {scale}, checkpoint {checkpoint}"
                if checkpoint is None:
                    lm_head, processor, full_weight = build_lm_head(
                        vocab_size, hidden, dtype=dtype, seed=11, logit_scale=scale
                    )
                    full_weight[700] = full_weight[5]
                    lm_head.weight.weight_loader(lm_head.weight, full_weight)
                else:
                    lm_head, processor, full_weight = build_shared_draft_head(
                        checkpoint, vocab_size, hidden, dtype=dtype, seed=11, tie=(700, 5)
                    )
                    report["quantized"] = dict(
                        checkpoint=checkpoint,
                        quant_method=type(lm_head.quant_method).__name__,
                        weight_dtype=str(lm_head.weight.dtype),
                    )
                width = lm_head.num_embeddings_per_partition
                report["flags"] = dict(
                    do_tensor_parallel_all_gather=processor.do_tensor_parallel_all_gather,
                    use_attn_tp_group=processor.use_attn_tp_group,
                    do_tensor_parallel_all_gather_dp_attn=(
                        processor.do_tensor_parallel_all_gather_dp_attn
                    ),
                )
                report["shard_width"] = width
                padded = torch.zeros(world * width, hidden, dtype=dtype)
                padded[:vocab_size] = full_weight
                if not torch.equal(lm_head.weight.data, padded[rank * width : (rank + 1) * width]):
                    failures.append(f"{where}: the loaded shard differs from the full weight")

                cases = [("decode", rows, None) for rows in range(1, 6)]
                cases.append(("draft_extend_v2", 8, torch.tensor([0, 7, 3, 3])))
                batches, picks = [], []
                for mode, rows, select_index in cases:
                    states = shared_hidden(rows, hidden, seed=1000 * rows + len(mode), dtype=dtype)
                    states[0] = full_weight[5].float().mul(40.0).to(dtype)
                    batches.append(states)
                    output = logits_forward(
                        processor, lm_head, states, mode=mode, select_index=select_index
                    )
                    picked = states if select_index is None else states[select_index]
                    want = reference_logits(picked, full_weight, world, width, logit_scale=scale)
                    problem = bits_differ(output.next_token_logits, want)
                    if problem:
                        failures.append(f"{where}, {mode}, {rows} rows: {problem}")
                    picks.append(sglang_pick(output, mode))
                    if int(picks[-1]["topk_index"][0]) != 5:
                        failures.append(f"{where}, {mode}: row 0 did not pick column 5")

                if not processor.enable_draft_argmax_exchange(lm_head, max_rows=8):
                    failures.append(f"{where}: the exchange did not engage")
                    continue
                report["route"] = peek(processor, ProcessorState).draft.route
                for (mode, rows, select_index), states, expected in zip(cases, batches, picks):
                    output = logits_forward(
                        processor, lm_head, states, mode=mode, select_index=select_index
                    )
                    if output.next_token_argmax_partials is None:
                        failures.append(f"{where}, {mode}, {rows} rows: no partials")
                        continue
                    ours = sglang_pick(output, mode)
                    for name, value in expected.items():
                        if value.dtype != ours[name].dtype or not torch.equal(value, ours[name]):
                            failures.append(
                                f"{where}, {mode}, {rows} rows: {name} {ours[name].tolist()}"
                                f", SGLang's {value.tolist()}"
                            )
                    report["checked"] += 1

            # One rank's opt-in check fails: every rank still agrees, and keeps the gather.
            from sglang_dsa_mtp.integration import vocab_shard_exchange as site

            lm_head, processor, _ = build_lm_head(vocab_size, hidden, dtype=dtype, seed=12)
            local_blocker = site._local_blocker
            if rank == 1:

                def broken(*args):
                    raise RuntimeError("rank 1 cannot tell")

                site._local_blocker = broken
            decision = site.opt_in(processor, lm_head, site.DRAFT)
            site._local_blocker = local_blocker
            report["reason_when_rank_1_fails"] = decision.reason
            report["engaged_when_rank_1_fails"] = peek(processor, ProcessorState).draft is not None

            # One rank's draft-worker check fails: every rank keeps the gather. Last: a rank left
            # waiting in a collective would otherwise meet the other rank's next one.
            from sglang_dsa_mtp import devices
            from sglang_dsa_mtp.integration import eagle_argmax as worker_site

            devices.cuda_blocker = lambda: None  # the gates' platform check: CUDA
            worker_site.get_batch_sizes_to_capture = lambda runner: ([1, 2, 4], None)
            worker, _ = build_draft_worker("unquantized", vocab_size, hidden, dtype=dtype, seed=13)
            worker.topk, worker.speculative_num_steps = (2 if rank == 1 else 1), 3
            with logged_lines("sglang_dsa_mtp") as lines:
                worker_site.opt_in_draft_model(worker)
            report["worker_lines_when_rank_1_fails"] = [
                line for line in lines if "draft_argmax_exchange" in line
            ]
            report["worker_engaged_when_rank_1_fails"] = (
                peek(worker.draft_runner.model.logits_processor, ProcessorState).draft is not None
            )
    finally:
        report["seconds"] = round(time.monotonic() - start, 2)
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures[:20]))
