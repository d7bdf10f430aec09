"""Draft argmax exchange scenarios shared by the tests and the benchmarks.

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

Real TP groups (SGLang's on CPUs or GPUs, a raw NCCL one) are in :mod:`support.tp`.
"""

from __future__ import annotations

import struct
from typing import Optional

import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support.constants import POISON
from support.reference import topk1_module

VOCAB = 154880  # GLM-5 / the spec's draft-step table
HIDDEN = 6144
PEAK = 100.0  # above every random background value, exact in bf16

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
# Rows that only compiled kernels can vouch for. Triton's interpreter converts bf16 subnormals to
# fp32 wrongly (it renormalizes them, then clamps the exponent at 0), so in bf16 the CPU gives other
# tokens than the GPU would: these run in the GPU tests (fp32 logits convert right everywhere).
COMPILED_ONLY_PATTERNS = ("subnormal-above-zeros", "subnormal-order")
ALL_PATTERNS = PATTERNS + COMPILED_ONLY_PATTERNS
INTERPRETER_SUBNORMALS = (
    "Triton's interpreter converts bf16 subnormals to fp32 wrongly: only a compiled kernel can "
    "vouch for them (GPU)"
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


def _bf16(bits: int) -> float:
    """The bf16 value of the 16-bit pattern ``bits`` (exact in fp32)."""
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def make_overlay(
    rows: int,
    tp_size: int,
    shard_width: int,
    vocab_size: int,
    *,
    split_n: Optional[int] = None,
    first_pattern: int = 0,
    patterns: tuple[str, ...] = PATTERNS,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(values, defined, names)``: fp32 ``[rows, tp_size * shard_width]`` pattern values, where
    ``defined`` is set (padding columns always are), and each row's pattern name (row ``i`` gets
    ``patterns[(first_pattern + i) % len(patterns)]``; :data:`ALL_PATTERNS` on compiled kernels)."""
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
        name = patterns[(first_pattern + i) % len(patterns)]
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
        elif name == "subnormal-above-zeros":  # the smallest bf16 subnormal beats +0.0 before it
            fill(-inf), put(a, 0.0), put(b, _bf16(0x807F)), put(next_rank, _bf16(0x0001))
            put(last, -0.0)
        elif name == "subnormal-order":  # bf16 subnormals one ulp apart
            fill(-inf), put(a, _bf16(0x0040)), put(other_split, _bf16(0x0001))
            put(next_rank, _bf16(0x0041)), put(last, _bf16(0x003F))
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
    patterns: tuple[str, ...] = PATTERNS,
) -> tuple[torch.Tensor, list[str]]:
    """Global CPU logits ``[rows, tp_size * shard_width]`` in ``dtype``: :func:`make_overlay`'s
    patterns over random normal values (times 4, so bf16 rounding leaves natural ties)."""
    values, defined, names = make_overlay(
        rows,
        tp_size,
        shard_width,
        vocab_size,
        split_n=split_n,
        first_pattern=first_pattern,
        patterns=patterns,
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
    draft_tokens = torch.full((rows, columns), POISON, dtype=torch.int64)
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
