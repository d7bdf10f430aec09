"""A real TP group for the GPU tests: one process per GPU, torch.distributed NCCL.

:func:`init_tp_group` joins this process to the group, :func:`make_all_reduce` gives the two
communication arms (NCCL, torch symmetric memory), and :func:`exchange_tp_worker` is the body of the
two-GPU test of the draft argmax exchange (started by :func:`process_group.run_group`). The TP
benchmarks share :func:`tp_size`, :func:`interleaved_times_us` and :func:`max_over_ranks`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from sglang_dsa_mtp.testing.argmax_cases import (
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
from sglang_dsa_mtp.testing.timing import capture_graph, replay_us

SLEEP_CYCLES = 2_000_000  # ~1 ms at 2 GHz: both hosts enqueue the timed replay meanwhile


def tp_size(requested: Optional[int], least: int = 2) -> Optional[int]:
    """The TP size a benchmark runs at: ``requested``, or every visible GPU; None, after saying why
    on stderr, when that is not between ``least`` and the visible GPU count."""
    import sys

    visible = torch.cuda.device_count()
    world = requested or visible
    if not least <= world <= visible:
        print(f"--num-gpu must be between {least} and the {visible} visible GPUs", file=sys.stderr)
        return None
    return world


def init_tp_group(rank: int, world: int, init_method: str) -> torch.device:
    """This process's GPU and an initialized NCCL default group (eager communicator)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=init_method, rank=rank, world_size=world, device_id=device
    )
    return device


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """``out[world * rows, ...]`` = every rank's ``tensor`` stacked along dim 0, on the default group
    (``all_gather_single`` where torch has it, else ``all_gather_into_tensor``)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, tensor)


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """``GroupCoordinator.all_gather(tensor, dim=-1)`` of SGLang 0.5.23, on the default group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    rows, width = tensor.shape
    out = torch.empty((world * rows, width), dtype=tensor.dtype, device=tensor.device)
    all_gather_flat(out, tensor.contiguous())
    return out.view(world, rows, width).movedim(0, 1).reshape(rows, world * width)


class ArmUnavailable(Exception):
    """The communication arm does not exist on this machine (a skip, not a failure): see
    :func:`symm_mem_unavailable`."""


def symm_mem_unavailable(device: torch.device, world: int) -> Optional[str]:
    """Why torch symmetric memory's one-shot all-reduce cannot exist here, or None.

    Two conditions only: this torch has no ``torch.ops.symm_mem.one_shot_all_reduce`` (a build
    without symmetric memory), or this rank's GPU cannot map a peer's memory
    (``torch.cuda.can_device_access_peer`` is False: no NVLink or PCIe P2P between them; rank r
    runs on GPU r). Anything else that goes wrong setting it up is a failure, not this."""
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce"
    blocked = [
        peer
        for peer in range(world)
        if peer != device.index and not torch.cuda.can_device_access_peer(device, peer)
    ]
    if blocked:
        return f"GPU {device.index} cannot access the memory of GPU {blocked} (no P2P)"
    return None


def make_all_reduce(comm: str, numel: int, device: torch.device):
    """``(buffer_for, all_reduce)`` for sum all-reduces of fp32 exchange buffers of up to ``numel``
    elements: ``buffer_for(shape)`` is a view of one persistent flat buffer, ``all_reduce(buf)``
    returns the reduced buffer.

    ``"nccl"``: ``torch.distributed.all_reduce`` in place (returns ``buf``). ``"symm_mem"``: the
    flat buffer is torch symmetric memory and the op is ``torch.ops.symm_mem.one_shot_all_reduce``
    (P2P loads, no multicast; returns a new tensor). Raises :class:`ArmUnavailable` only where
    :func:`symm_mem_unavailable` says why the op cannot exist here; any other set-up error
    propagates.
    """
    import torch.distributed as dist

    def views(flat):
        def buffer_for(shape):
            count = shape[0] * shape[1]
            if count > numel:
                raise ValueError(f"an exchange of {shape} needs more than {numel} elements")
            return flat[:count].view(shape)

        return buffer_for

    if comm == "nccl":

        def nccl_all_reduce(buf):
            dist.all_reduce(buf)
            return buf

        return views(torch.zeros(numel, dtype=torch.float32, device=device)), nccl_all_reduce
    if comm != "symm_mem":
        raise ValueError(f"comm must be 'nccl' or 'symm_mem', got {comm!r}")
    unavailable = symm_mem_unavailable(device, dist.get_world_size())
    if unavailable is not None:
        raise ArmUnavailable(f"torch symmetric memory one-shot all-reduce: {unavailable}")
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not hasattr(enable, "__deprecated__"):
        enable(group_name)  # needed by a torch that has not deprecated it yet
    flat = symm_mem.empty(numel, dtype=torch.float32, device=device)
    symm_mem.rendezvous(flat, group_name)
    op = torch.ops.symm_mem.one_shot_all_reduce
    flat.zero_()
    op(flat, "sum", group_name)
    torch.cuda.synchronize()

    def symm_all_reduce(buf):
        return op(buf, "sum", group_name)

    return views(flat), symm_all_reduce


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
                hidden = _shared_hidden(rows, seed=vocab * 100 + rows, device=device)
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


def _shared_hidden(rows: int, *, seed: int, device) -> torch.Tensor:
    """The same hidden states on every rank (drawn on the CPU from a shared seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)


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
    static_hidden = _shared_hidden(rows, seed=7, device=device)
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
        static_hidden.copy_(_shared_hidden(rows, seed=vocab + 31 * replay + rows, device=device))
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


def interleaved_times_us(graphs: dict, calls: int, replays: int) -> dict:
    """Median microseconds per call of each graph (anything with ``replay()``, holding ``calls``
    calls) over ``replays`` rounds; each round replays every graph once, in turn, so that clock and
    power drift reach all arms alike. Before each timed replay the ranks meet on the GPU (a sleep
    kernel, then a one-element all-reduce on the default group, both outside the timed events), so
    that no rank's time includes waiting for another rank's host to launch."""
    import torch.distributed as dist

    meet = torch.zeros(1, device="cuda")
    times = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(meet)
            times[name].append(replay_us(graph))
    return {name: statistics.median(t) / calls for name, t in times.items()}


def max_over_ranks(value: float) -> float:
    """The maximum of ``value`` over the ranks of the default group."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
