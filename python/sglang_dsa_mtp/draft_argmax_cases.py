"""Draft argmax exchange scenarios shared by the tests, the benchmark and ``python -m sglang_dsa_mtp``.

* :func:`make_overlay` / :func:`make_logits`: global ``[rows, tp_size * shard_width]`` logits whose
  rows carry the hard cases of the greedy pick (:data:`PATTERNS`: ties inside a split, across splits
  and across ranks, NaN before and after the maximum, all-NaN rows, +inf, all -inf rows, -0.0 against
  +0.0, fp32(-1e30) against NaN, ...), over random values, with adversarial vocab padding (+inf, NaN,
  1e30 in every column at global index ``>= vocab_size``).
* :func:`rank_buffers` emulates a TP group on one device: each rank's
  :func:`draft_argmax_partials` on its slice of the global logits; :func:`sum_buffers` adds them
  up in a given order, as a sum all-reduce would.
* :func:`reference_pick`: the gathered path of SGLang 0.5.23: the logits sliced to
  ``[:, :vocab_size]``, converted to fp32, then SGLang's own ``draft_topk1_postprocess`` (loaded by
  file path, ``nan_policy="sanitize"``) or ``torch.argmax`` (``"propagate"``).
* :func:`run_group` starts a real TP group (one process per GPU, torch.distributed NCCL) and
  :func:`exchange_tp_worker` is the two-GPU test's body.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from sglang_dsa_mtp.reference import topk1_module
from sglang_dsa_mtp.selfcheck import capture_graph

VOCAB = 154880  # GLM-5 / the spec's draft-step table
HIDDEN = 6144
PEAK = 100.0  # above every random background value, exact in bf16
POISON_TOKEN = -0x2B2B2B2B  # draft_tokens start with this

# Row patterns, cycled over the rows of a case (row i gets PATTERNS[(first + i) % len]).
PATTERNS = (
    "random",
    "tie-in-split",
    "tie-across-splits",
    "tie-across-ranks",
    "nan-before-max",
    "nan-after-max",
    "all-nan",
    "pos-inf-ties",
    "all-neg-inf",
    "neg-inf-and-nan",
    "signed-zeros",
    "plus-zero-first",
    "neg-1e30-vs-nan",
    "nan-vs-below-neg-1e30",
    "nan-vs-above-neg-1e30",
    "max-at-vocab-end",
    "max-at-first-and-last",
    "negative-nan",
    "padding-only-specials",
    "coarse-ties",
    "low-bit-near-ties",
)


# fp32 neighbours of -1e30 (the value NaN counts as under draft_topk1_postprocess).
_NEG_1E30_DOWN = torch.nextafter(torch.tensor(-1e30), torch.tensor(-float("inf"))).item()
_NEG_1E30_UP = torch.nextafter(torch.tensor(-1e30), torch.tensor(0.0)).item()


def padded_shard_width(vocab_size: int, tp_size: int, padding: int = 64) -> int:
    """Columns per rank of SGLang's ``ParallelLMHead`` (``VocabParallelEmbedding`` padding rule)."""
    padded = -(-vocab_size // padding) * padding
    if padded % tp_size:
        padded = -(-vocab_size // (padding * tp_size)) * padding * tp_size
    return padded // tp_size


def _peak_plus(ulps: int) -> float:
    """PEAK with ``ulps`` added to its fp32 bit pattern (the same value once rounded to bf16)."""
    bits = torch.tensor([PEAK], dtype=torch.float32).view(torch.int32) + ulps
    return bits.view(torch.float32).item()


def _nan_with_sign() -> torch.Tensor:
    return torch.tensor([-4194303], dtype=torch.int32).view(torch.float32)  # 0xFFC00001


def make_overlay(
    rows: int,
    tp_size: int,
    shard_width: int,
    vocab_size: int,
    *,
    split_n: Optional[int] = None,
    first_pattern: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(values, defined, names)``: fp32 ``[rows, tp_size * shard_width]`` pattern values, where
    ``defined`` is set (padding columns always are), and each row's pattern name."""
    split_n = dap.SPLIT_N if split_n is None else split_n
    width = tp_size * shard_width
    values = torch.zeros(rows, width)
    defined = torch.zeros(rows, width, dtype=torch.bool)
    inf, nan = float("inf"), float("nan")
    padding = torch.tensor([inf, nan, 1e30, -0.0])
    if width > vocab_size:
        values[:, vocab_size:] = padding.repeat(width)[: width - vocab_size]
        defined[:, vocab_size:] = True

    last = vocab_size - 1

    def col(c: int) -> int:
        return max(0, min(c, last))

    a, b = col(1), col(2)  # inside split 0 of rank 0
    other_split = col(min(split_n + 3, shard_width - 1))  # split 1 of rank 0 (when there is one)
    rank_edge = col(shard_width - 1)  # last column of rank 0
    next_rank = col(shard_width)  # first column of rank 1
    last_rank_first = col((last // shard_width) * shard_width)
    names = []
    for i in range(rows):
        name = PATTERNS[(first_pattern + i) % len(PATTERNS)]
        names.append(name)
        v, d = values[i], defined[i]

        def put(c, x, v=v, d=d):
            v[c] = x
            d[c] = True

        def fill(x, v=v, d=d):
            v[:vocab_size] = x
            d[:vocab_size] = True

        if name == "tie-in-split":
            put(b, PEAK), put(a, PEAK), put(col(a + 5), PEAK)
        elif name == "tie-across-splits":
            put(other_split, PEAK), put(b, PEAK)
        elif name == "tie-across-ranks":
            put(last_rank_first, PEAK), put(next_rank, PEAK), put(rank_edge, PEAK)
        elif name == "nan-before-max":
            put(a, nan), put(last_rank_first, PEAK)
        elif name == "nan-after-max":
            put(a, PEAK), put(last, nan), put(next_rank, nan)
        elif name == "all-nan":
            fill(nan)
        elif name == "pos-inf-ties":
            put(last, inf), put(next_rank, inf), put(other_split, inf)
        elif name == "all-neg-inf":
            fill(-inf)
        elif name == "neg-inf-and-nan":
            fill(-inf), put(next_rank, nan), put(last, nan)
        elif name == "signed-zeros":
            fill(-inf), put(b, -0.0), put(next_rank, 0.0), put(last, -0.0)
        elif name == "plus-zero-first":
            fill(-inf), put(b, 0.0), put(other_split, -0.0)
        elif name == "neg-1e30-vs-nan":  # a tie when the logits are fp32: the lowest wins
            fill(-inf), put(a, nan), put(b, -1e30), put(next_rank, -1e30), put(last, nan)
        elif name == "nan-vs-below-neg-1e30":
            fill(-inf), put(a, _NEG_1E30_DOWN), put(last, nan)
        elif name == "nan-vs-above-neg-1e30":
            fill(-inf), put(a, nan), put(last, _NEG_1E30_UP)
        elif name == "max-at-vocab-end":
            put(last, PEAK)
        elif name == "max-at-first-and-last":
            put(last, PEAK), put(0, PEAK)
        elif name == "negative-nan":
            v[a] = _nan_with_sign()[0]
            d[a] = True
            put(next_rank, PEAK)
        elif name == "padding-only-specials":
            fill(-inf)
        elif name == "low-bit-near-ties":  # fp32 maxima apart in the low 16 bits only
            put(a, _peak_plus(1)), put(b, _peak_plus(0x0FFF)), put(next_rank, _peak_plus(0x1000))
        elif name == "coarse-ties":
            v[:vocab_size] = (torch.arange(vocab_size) * 7919 % 5).float() - 2.0
            d[:vocab_size] = True
    return values, defined, names


def make_logits(
    rows: int,
    tp_size: int,
    shard_width: int,
    vocab_size: int,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    split_n: Optional[int] = None,
    first_pattern: int = 0,
) -> tuple[torch.Tensor, list[str]]:
    """Global CPU logits ``[rows, tp_size * shard_width]`` in ``dtype``: :func:`make_overlay`'s
    patterns over random normal values (times 4, so bf16 rounding leaves natural ties)."""
    values, defined, names = make_overlay(
        rows, tp_size, shard_width, vocab_size, split_n=split_n, first_pattern=first_pattern
    )
    background = torch.randn(rows, tp_size * shard_width, generator=generator) * 4
    return torch.where(defined, values, background).to(dtype), names


def rank_buffers(
    logits: torch.Tensor,
    tp_size: int,
    vocab_size: int,
    *,
    contiguous: bool = False,
    outs: Optional[list[torch.Tensor]] = None,
) -> list[torch.Tensor]:
    """Each emulated rank's exchange buffer, from its slice of the global logits (a strided view
    unless ``contiguous``)."""
    shard_width = logits.shape[1] // tp_size
    buffers = []
    for rank in range(tp_size):
        shard = logits[:, rank * shard_width : (rank + 1) * shard_width]
        if contiguous:
            shard = shard.contiguous()
        buffers.append(
            dap.draft_argmax_partials(
                shard,
                tp_rank=rank,
                tp_size=tp_size,
                vocab_size=vocab_size,
                out=None if outs is None else outs[rank],
            )
        )
    return buffers


def sum_buffers(buffers: list[torch.Tensor], order: Optional[list[int]] = None) -> torch.Tensor:
    """Element-wise fp32 sum of the buffers, left to right in ``order`` (default: rank order);
    ``order="tree"`` adds neighbours pairwise, as a reduce-scatter over a binary tree would."""
    if order == "tree":
        level = list(buffers)
        while len(level) > 1:
            level = [
                level[i] + level[i + 1] if i + 1 < len(level) else level[i]
                for i in range(0, len(level), 2)
            ]
        return level[0].clone()
    order = list(range(len(buffers))) if order is None else order
    total = buffers[order[0]].clone()
    for rank in order[1:]:
        total += buffers[rank]
    return total


def sum_orders(tp_size: int, generator: torch.Generator) -> list:
    """Rank order, reverse, a random permutation, and the pairwise tree."""
    shuffled = torch.randperm(tp_size, generator=generator).tolist()
    return [list(range(tp_size)), list(range(tp_size))[::-1], shuffled, "tree"]


def slot_violations(buffers: list[torch.Tensor], vocab_size: int) -> list[str]:
    """Where a rank's buffer breaks the exchange contract: anything but exact +0.0 outside its
    slot; inside it, a lane that is not an integer in [0, 2**24] or is -0.0; a column >= vocab."""
    problems = []
    tp_size = len(buffers)
    for rank, buf in enumerate(buffers):
        view = buf.view(buf.shape[0], tp_size, -1, dap.LANES)
        bits = view.view(torch.int32)
        others = torch.ones(tp_size, dtype=torch.bool)
        others[rank] = False
        if bool((bits[:, others] != 0).any()):
            problems.append(f"rank {rank}: non-(+0.0) bits outside its slot")
        own, own_bits = view[:, rank], bits[:, rank]
        if not bool(torch.isfinite(own).all()):
            problems.append(f"rank {rank}: a non-finite lane")
            continue
        if bool((own_bits == torch.iinfo(torch.int32).min).any()):
            problems.append(f"rank {rank}: a -0.0 lane")
        if bool(((own < 0) | (own > (1 << 24)) | (own != own.round())).any()):
            problems.append(f"rank {rank}: a lane that is not an integer in [0, 2**24]")
        if bool((own[..., :2] > 0xFFFF).any()):
            problems.append(f"rank {rank}: a key lane above 16 bits")
        if bool((own[..., 2] >= vocab_size).any()) or bool((own[..., 3] > vocab_size).any()):
            problems.append(f"rank {rank}: a column at or past vocab_size")
    return problems


def reference_pick(
    logits: torch.Tensor,
    vocab_size: int,
    nan_policy: str,
    positions: Optional[torch.Tensor] = None,
    draft_tokens: Optional[torch.Tensor] = None,
    draft_token_column: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang 0.5.23's gathered pick on global logits (``[rows, >= vocab_size]``, any dtype):
    ``[:, :vocab_size]`` as fp32, then ``draft_topk1_postprocess`` (``"sanitize"``, advancing
    ``positions`` and writing the draft-token column as it does) or ``torch.argmax`` with the same
    side effects (``"propagate"``)."""
    gathered = logits[:, :vocab_size].float().contiguous()  # as the all-gather leaves it
    if nan_policy == "sanitize":
        scratch = positions
        if scratch is None:
            scratch = torch.zeros(gathered.shape[0], dtype=torch.int64, device=gathered.device)
        return topk1_module().draft_topk1_postprocess(
            gathered, scratch, draft_tokens, draft_token_column
        )
    if nan_policy != "propagate":
        raise ValueError(f"unknown nan_policy {nan_policy!r}")
    topk_index = torch.argmax(gathered, dim=-1, keepdim=True)
    topk_p = torch.ones(topk_index.shape, dtype=torch.float32, device=gathered.device)
    if positions is not None:
        positions.add_(1)
    if draft_tokens is not None:
        draft_tokens[:, draft_token_column] = topk_index[:, 0]
    return topk_p, topk_index


def pick_state(rows: int, device, *, columns: int = 4, positions_dtype=torch.int64):
    """Fresh ``(positions, draft_tokens)``: positions 1000 + 7 * row, draft tokens poisoned."""
    positions = (1000 + 7 * torch.arange(rows, dtype=torch.int64)).to(positions_dtype)
    draft_tokens = torch.full((rows, columns), POISON_TOKEN, dtype=torch.int64)
    return positions.to(device), draft_tokens.to(device)


def differences(ours: dict, expected: dict) -> list[str]:
    """Names of the outputs that differ (dtype, shape or any element) between two picks."""
    out = []
    for name, want in expected.items():
        got = ours[name]
        if want is None and got is None:
            continue
        if (
            got is None
            or want is None
            or got.dtype != want.dtype
            or got.shape != want.shape
            or not torch.equal(got, want)
        ):
            out.append(name)
    return out


def describe(ours: dict, expected: dict, names: Optional[list[str]] = None) -> str:
    """The first differing rows of topk_index, with their pattern names."""
    got, want = ours["topk_index"].view(-1).cpu(), expected["topk_index"].view(-1).cpu()
    rows = (got != want).nonzero().view(-1).tolist()[:8]
    parts = []
    for r in rows:
        label = f" ({names[r]})" if names else ""
        parts.append(f"row {r}{label}: ours {got[r].item()}, expected {want[r].item()}")
    return "; ".join(parts)


def check_pick(
    exchange: torch.Tensor,
    logits: torch.Tensor,
    vocab_size: int,
    nan_policy: str,
    *,
    draft_token_column: int = 1,
    positions_dtype=torch.int64,
    names: Optional[list[str]] = None,
) -> list[str]:
    """Finalize ``exchange`` and run the reference on ``logits``, each with its own fresh
    positions and poisoned draft tokens; returns descriptions of every difference (empty: equal)."""
    rows, device = exchange.shape[0], exchange.device
    positions, draft_tokens = pick_state(rows, device, positions_dtype=positions_dtype)
    ref_positions, ref_tokens = positions.clone(), draft_tokens.clone()
    topk_p, topk_index = dap.draft_argmax_finalize(
        exchange, positions, draft_tokens, draft_token_column, nan_policy=nan_policy
    )
    ref_p, ref_index = reference_pick(
        logits.to(device), vocab_size, nan_policy, ref_positions, ref_tokens, draft_token_column
    )
    ours = dict(
        topk_p=topk_p, topk_index=topk_index, positions=positions, draft_tokens=draft_tokens
    )
    want = dict(
        topk_p=ref_p, topk_index=ref_index, positions=ref_positions, draft_tokens=ref_tokens
    )
    differing = differences(ours, want)
    if not differing:
        return []
    return [f"{nan_policy}: {', '.join(differing)} differ; {describe(ours, want, names)}"]


# ----------------------------------------------------------------------------------------------
# A real TP group: one process per GPU, torch.distributed NCCL
# ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(fn: Callable, world: int, *args, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` spawned processes and wait.

    A process that raises makes this raise (with its traceback); the others are terminated. Past
    ``timeout_s`` every process still alive is terminated and TimeoutError is raised.
    """
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(
        fn, args=(world, init_method, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-process group did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


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
    """The communication arm cannot be set up on this machine (a skip, not a failure)."""


def make_all_reduce(comm: str, numel: int, device: torch.device):
    """``(buffer_for, all_reduce)`` for sum all-reduces of fp32 exchange buffers of up to ``numel``
    elements: ``buffer_for(shape)`` is a view of one persistent flat buffer, ``all_reduce(buf)``
    returns the reduced buffer.

    ``"nccl"``: ``torch.distributed.all_reduce`` in place (returns ``buf``). ``"symm_mem"``: the
    flat buffer is torch symmetric memory and the op is ``torch.ops.symm_mem.one_shot_all_reduce``
    (P2P loads, no multicast; returns a new tensor). Raises :class:`ArmUnavailable` when the
    symmetric-memory set-up fails.
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
    group_name = dist.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:
                pass  # deprecated or not needed in this torch
        flat = symm_mem.empty(numel, dtype=torch.float32, device=device)
        symm_mem.rendezvous(flat, group_name)
        op = torch.ops.symm_mem.one_shot_all_reduce
        flat.zero_()
        op(flat, "sum", group_name)
        torch.cuda.synchronize()
    except Exception as exc:  # not available on this torch or machine
        raise ArmUnavailable(f"torch symmetric memory one-shot all-reduce: {exc!r}") from exc

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


def read_reports(result_dir: str, world: int) -> list[dict]:
    """The ``rank<r>.json`` reports :func:`exchange_tp_worker` wrote, one per rank."""
    return [
        json.loads(Path(result_dir, f"rank{rank}.json").read_text())
        for rank in range(world)
        if os.path.exists(Path(result_dir, f"rank{rank}.json"))
    ]
