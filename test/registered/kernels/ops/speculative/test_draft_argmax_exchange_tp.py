"""The draft argmax exchange in a real TP group: one process per visible GPU, torch.distributed NCCL.

What runs where: this module needs two or more CUDA GPUs (2 GPUs: TP 2; 4 or 8 GPUs give TP 4 or 8,
the TP size follows ``torch.cuda.device_count()``) and only torch, triton, this package
and SGLang 0.5.23's files (for ``draft_topk1_postprocess``, loaded by file path). SGLang's own
``LogitsProcessor`` forward with the exchange on and off needs SGLang's dependencies, which a GPU
machine set up from the wheel (``test/gpu_env.sh``) lacks; that part is tested in a CPU process
group where SGLang imports.

Each rank (:func:`exchange_tp_worker`, here): a real bf16 LM-head GEMM of shared random hidden
states (hidden 6144) against its own weight shard, for vocab 154880, 129281 and 1001 (SGLang's padded
shards; the padded columns hold +inf / NaN / 1e30 and the rows carry the hard patterns), rows 1..16:

* partials, the sum all-reduce, finalize with both NaN policies;
* the all-reduce is exact: it equals every rank's pre-reduce buffer (all-gathered) summed locally in
  rank order, reversed, shuffled and pairwise;
* tokens, topk_p, positions and draft tokens equal SGLang's gathered path on the all-gathered logits
  (``draft_topk1_postprocess``; ``torch.argmax`` for ``propagate``);
* the whole step (GEMM + partials + all-reduce + both finalizes) captured in a CUDA graph at rows 1,
  5 and 16 and replayed with new hidden states, each replay checked the same way.

Two all-reduces: NCCL through ``torch.distributed.all_reduce``, and torch symmetric memory's
one-shot all-reduce (P2P, no multicast). The symmetric-memory arm is skipped, with the reason, only
where it cannot exist (``support.tp.symm_mem_unavailable``: a torch without the op, or GPUs without P2P
access to each other); any other error setting it up fails the test.
Environment settings such as NCCL_NVLS_ENABLE=0 or TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are left as they
are.
"""

import json
from pathlib import Path

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support.argmax_cases import (
    HIDDEN,
    VOCAB,
    check_pick,
    differences,
    make_overlay,
    padded_shard_width,
    pick_state,
    reference_pick,
    slot_violations,
    sum_buffers,
    sum_orders,
)
from support.timing import capture_graph
from support.tp import (
    ArmUnavailable,
    all_gather_flat,
    all_gather_last_dim,
    init_tp_group,
    make_all_reduce,
    read_reports,
    run_group,
    shared_hidden,
)

pytestmark = pytest.mark.gpu


def tp_size() -> int:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs at least 2 CUDA GPUs for a real TP group, found {count}")
    return count


@pytest.mark.parametrize("comm", ["nccl", "symm_mem"])
def test_exchange_in_a_real_tp_group(comm, tmp_path):
    world = tp_size()
    run_group(exchange_tp_worker, world, str(tmp_path), comm, timeout_s=900)
    reports = read_reports(str(tmp_path), world)
    assert len(reports) == world, f"only {len(reports)} of {world} ranks reported"
    skipped = sorted({r["skipped"] for r in reports if r.get("skipped")})
    if skipped:
        assert comm == "symm_mem", skipped
        pytest.skip("; ".join(skipped))
    for report in reports:
        assert not report["failures"], report["failures"]
        # 3 vocabs x (16 eager row counts + 3 graph row counts x 3 replays)
        assert report["checked"] == 3 * (16 + 3 * 3), report


# --- each rank's body: run_group spawns it, pickled by this module's name ---


def exchange_tp_worker(
    rank: int,
    world: int,
    init_method: str,
    result_dir: str,
    comm: str,
    vocabs: tuple[int, ...] = (VOCAB, 129281, 1001),
    graph_rows: tuple[int, ...] = (1, 5, 16),
    replays: int = 3,
) -> None:
    """Body of the real TP test, one process per GPU; writes ``rank<r>.json`` into ``result_dir``.

    Each rank: a real bf16 LM-head GEMM of shared random hidden states against its own weight shard
    (hidden 6144; the padded columns and the :data:`PATTERNS` of each row overwrite the GEMM's
    logits), partials, the sum all-reduce of ``comm``, finalize with both NaN policies. Checked
    against every rank's pre-reduce buffer summed in several orders (bit for bit: the all-reduce
    is exact) and against SGLang's gathered path on the all-gathered logits (tokens, topk_p,
    positions, draft tokens). Then the whole step (GEMM + overlay + partials + all-reduce + both
    finalizes) is captured in a CUDA graph and replayed with new hidden states, each replay checked
    the same way against the logits the graph produced.
    """
    import torch.distributed as dist

    device = init_tp_group(rank, world, init_method)
    report = {"rank": rank, "world": world, "comm": comm, "checked": 0, "failures": []}
    failures = report["failures"]
    try:
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm)
        for vocab in vocabs:
            width = padded_shard_width(vocab, world)
            rows_max = 16
            gen = torch.Generator(device=device).manual_seed(1234 + rank)
            weight = torch.randn(width, HIDDEN, generator=gen, device=device)
            weight = (weight * 0.02).to(torch.bfloat16)
            values, defined, names = make_overlay(rows_max, world, width, vocab)
            shard = slice(rank * width, (rank + 1) * width)
            values = values[:, shard].to(torch.bfloat16).to(device)
            defined = defined[:, shard].to(device)
            buffer_for, all_reduce = make_all_reduce(
                comm, rows_max * dap.exchange_shape(1, width, world)[1], device
            )

            def step(hidden, rows, out, weight=weight, values=values, defined=defined):
                logits = torch.matmul(hidden, weight.T)
                logits = torch.where(defined[:rows], values[:rows], logits)
                exchange = dap.draft_argmax_partials(
                    logits, tp_rank=rank, tp_size=world, vocab_size=vocab, out=out
                )
                return logits, exchange

            for rows in range(1, rows_max + 1):
                hidden = shared_hidden(rows, HIDDEN, seed=vocab * 100 + rows, device=device)
                buffer = buffer_for(dap.exchange_shape(rows, width, world))
                logits, exchange = step(hidden, rows, buffer)
                before = exchange.clone()
                reduced = all_reduce(exchange)
                where = f"vocab {vocab}, rows {rows}, eager"
                failures += _check_exact_sum(before, reduced, vocab, where)
                failures += _check_against_gather(reduced, logits, vocab, names[:rows], where)
                report["checked"] += 1

            for rows in graph_rows:
                buffer = buffer_for(dap.exchange_shape(rows, width, world))
                failures += _graph_replays(
                    buffer, all_reduce, rank, world, vocab, rows, step, names[:rows], replays
                )
                report["checked"] += replays
    except ArmUnavailable as exc:
        report["skipped"] = str(exc)
    finally:
        torch.cuda.synchronize()
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
        dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures[:20]))


def _check_exact_sum(before: torch.Tensor, reduced: torch.Tensor, vocab: int, where: str):
    """The all-reduced buffer equals every rank's buffer summed locally, in several orders."""
    import torch.distributed as dist

    world = dist.get_world_size()
    rows, width = before.shape
    gathered = torch.empty((world * rows, width), dtype=before.dtype, device=before.device)
    all_gather_flat(gathered, before.contiguous())
    buffers = list(gathered.view(world, rows, width).unbind(0))
    problems = [f"{where}: {p}" for p in slot_violations(buffers, vocab)]
    gen = torch.Generator().manual_seed(world)
    for order in sum_orders(world, gen):
        if not torch.equal(sum_buffers(buffers, order), reduced):
            problems.append(f"{where}: the all-reduce differs from the local sum in order {order}")
    return problems


def _check_against_gather(reduced, logits, vocab, names, where) -> list[str]:
    """Both policies against SGLang's gathered path on the all-gathered logits."""
    gathered = all_gather_last_dim(logits)
    problems = []
    for policy in dap.NAN_POLICIES:
        problems += [
            f"{where}: {p}" for p in check_pick(reduced, gathered, vocab, policy, names=names)
        ]
    return problems


def _graph_replays(buffer, all_reduce, rank, world, vocab, rows, step, names, replays):
    """Capture GEMM + partials + all-reduce + finalize (both policies), check each replay."""
    device = buffer.device
    static_hidden = shared_hidden(rows, HIDDEN, seed=7, device=device)
    positions, draft_tokens = pick_state(rows, device)

    def body():
        logits, exchange = step(static_hidden, rows, buffer)
        reduced = all_reduce(exchange)
        sanitize = dap.draft_argmax_finalize(reduced, positions, draft_tokens, 1)
        propagate = dap.draft_argmax_finalize(reduced, nan_policy="propagate")
        return logits, reduced, sanitize, propagate

    graph, captured = capture_graph(body, warmups=2, capture_error_mode="thread_local")
    logits, reduced, (topk_p, topk_index), (prop_p, prop_index) = captured

    problems, seen = [], set()
    for replay in range(replays):
        where = f"vocab {vocab}, rows {rows}, CUDA graph replay {replay}"
        static_hidden.copy_(
            shared_hidden(rows, HIDDEN, seed=vocab + 31 * replay + rows, device=device)
        )
        fresh_positions, fresh_tokens = pick_state(rows, device)
        positions.copy_(fresh_positions)
        draft_tokens.copy_(fresh_tokens)
        graph.replay()
        torch.cuda.synchronize()
        # Eager recomputation from the logits this replay produced.
        eager = dap.draft_argmax_partials(logits, tp_rank=rank, tp_size=world, vocab_size=vocab)
        problems += _check_exact_sum(eager, reduced, vocab, where)
        gathered = all_gather_last_dim(logits)
        ref_positions, ref_tokens = fresh_positions.clone(), fresh_tokens.clone()
        ref_p, ref_index = reference_pick(gathered, vocab, "sanitize", ref_positions, ref_tokens, 1)
        arg_p, arg_index = reference_pick(gathered, vocab, "propagate")
        ours = dict(topk_p=topk_p, topk_index=topk_index, positions=positions, tokens=draft_tokens)
        want = dict(topk_p=ref_p, topk_index=ref_index, positions=ref_positions, tokens=ref_tokens)
        ours.update(prop_p=prop_p, prop_index=prop_index)
        want.update(prop_p=arg_p, prop_index=arg_index)
        differing = differences(ours, want)
        if differing:
            problems.append(f"{where}: {', '.join(differing)} differ from the gathered path")
        seen.add(tuple(topk_index.view(-1).tolist()))
    if replays > 1 and len(seen) == 1:
        problems.append(f"vocab {vocab}, rows {rows}: every replay picked the same tokens")
    return problems
