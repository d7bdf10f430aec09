"""The vocab-shard argmax exchange both call sites share: the greedy draft's
(``draft_argmax_exchange``) and the target verify's (``verify_argmax_exchange``).

An engaged ``LogitsProcessor`` reduces its rank's LM-head shard to argmax partials
(``draft_argmax_partials``) summed by SGLang's own TP all-reduce, instead of gathering the logits.
This module owns what the two have in common: the checks that SGLang's LM-head path is a plain
matmul over the rank's contiguous vocab shard (:func:`lm_head_blocker`, :func:`logits_dtypes`), the
shard's layout, all-reduce route and kernels compiled ahead (:func:`shard_exchange_blocker`), the
ranks' agreement on the answer (:func:`agreed_blocker`) and the engaged state
(:func:`engage_processor`), the logits tail run ahead in lockstep across the ranks
(:func:`warm_up_gathers`, :func:`agreed_warm_up`), and the target verify's kept shard
(:func:`keep_in_buffer`, :func:`kept_shard_of`, :func:`full_logits`): the shard and the picked
tokens live inside the storage of SGLang's fp32 logits buffer, the one every target-verify graph
shares, so a captured graph keeps no memory of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from sglang.srt.layers import logits_processor as sglang_logits
from sglang.srt.layers.logits_processor import LogitsMetadata
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from torch.multiprocessing.reductions import StorageWeakRef

from sglang_dsa_mtp.integration.state import ProcessorState, state_of
from sglang_dsa_mtp.integration.tp_all_reduce import agree_across_group, all_reduce_route
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
    LOGITS_DTYPES,
    PartialsLayout,
    exchange_shape,
    partials_layout,
    warm_up,
)
from sglang_dsa_mtp.log import log_once

TOKEN_DTYPE = torch.int64  # the picked tokens, as SGLang's argmax gives them
BUFFER_DTYPE = torch.float32  # SGLang's logits buffer


@dataclass(frozen=True)
class Exchange:
    """An engaged processor's exchange: its LM head, its shard's checked layout, the route."""

    lm_head: torch.nn.Module
    layout: PartialsLayout
    route: str


# --- the checks ----------------------------------------------------------------------------------


def lm_head_quant(lm_head) -> tuple[str, bool]:
    """(the head's quant method class, whether SGLang's LM-head path applies it).

    The answer is SGLang's own ``should_apply_lm_head_quant_method``, which its
    ``LogitsProcessor._compute_lm_head`` asks at every call (the module defines it twice; the later
    definition is the one the module name holds, and the one asked here). A NextN draft head built
    with a ModelOpt quant config keeps its ``ModelOptFp4LinearMethod`` after SGLang swaps in the
    target's bf16 weight: the method is then not applied, and the head is a plain matmul."""
    method = getattr(lm_head, "quant_method", None)
    name = type(method).__name__ if method is not None else "none"
    return name, bool(sglang_logits.should_apply_lm_head_quant_method(lm_head, method))


def lm_head_blocker(lm_head, group) -> Optional[str]:
    """Why SGLang's LM-head path for ``lm_head`` is not a plain bf16/fp32 matmul over this rank's
    contiguous vocab shard (the only layout the partials read), or None."""
    if hasattr(lm_head, "set_lora"):
        return "the LM head is LoRA-wrapped"
    if not isinstance(lm_head, ParallelLMHead):
        return f"the LM head is a {type(lm_head).__name__}, not a vocab-parallel ParallelLMHead"
    if not lm_head.enable_tp or lm_head.use_attn_tp_group:
        return "the LM head is not sharded over the TP group"
    quant_method, applied = lm_head_quant(lm_head)
    if applied:
        return (
            f"SGLang applies the LM head's quant method {quant_method} (a quantized LM-head kernel)"
        )
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return f"the LM head has no plain weight (SGLang runs its quant method {quant_method})"
    if getattr(lm_head, "bias", None) is not None:
        return "the LM head has a bias"
    if lm_head.num_added_embeddings:
        return f"the LM head has {lm_head.num_added_embeddings} added (LoRA) vocab entries"
    if weight.dtype not in LOGITS_DTYPES:
        return f"the LM head weight is {weight.dtype}, the partials take bf16 or fp32"
    if lm_head.tp_size != group.world_size:
        return f"the LM head has {lm_head.tp_size} shards, the TP group {group.world_size} ranks"
    width = lm_head.num_embeddings_per_partition
    start = lm_head.shard_indices.padded_org_vocab_start_index
    if start != group.rank_in_group * width or weight.shape[0] != width:
        return "the LM head's shard is not the rank's contiguous slice of the vocab"
    return None


def logits_dtypes(processor, lm_head) -> tuple[torch.dtype, ...]:
    """The dtypes SGLang's ``_compute_lm_head`` can give this head's shard logits: fp32 with
    ``--enable-fp32-lm-head``; else the weight's, plus fp32 with an fp32 LM-head output, plus bf16
    under an RL on-policy target (it casts the matmul to bf16)."""
    if processor.use_fp32_lm_head:
        return (torch.float32,)
    dtypes = [lm_head.weight.dtype]
    if processor.use_fp32_lm_head_output:
        dtypes.append(torch.float32)
    if getattr(processor, "rl_on_policy_target", None) is not None:
        dtypes.append(torch.bfloat16)
    return tuple(dict.fromkeys(dtypes))


def head_facts(lm_head) -> dict:
    """The LM head's facts for the log line, as far as they can be read."""
    facts = {}
    try:
        quant_method, applied = lm_head_quant(lm_head)
        facts["LM-head quant method"] = (
            f"{quant_method} ({'applied' if applied else 'not applied'} by SGLang)"
        )
    except Exception as exc:
        facts["LM-head quant method"] = f"unknown ({type(exc).__name__})"
    weight = getattr(lm_head, "weight", None)
    facts["head dtype"] = (
        str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else "none"
    )
    return facts


def shard_exchange_blocker(
    processor, lm_head, group, rows: list[int], facts: dict, *, draft_steps: Optional[int] = None
) -> Optional[str]:
    """The checks both exchanges make once the switch, the processor and the LM head allow one: the
    logits dtypes, the shard's layout, the all-reduce route of the exchange buffer at 1 and the
    most ``rows`` (never NCCL inside a CUDA-graph capture), and every kernel variant for ``rows``
    compiled ahead. Why this rank must keep SGLang's gather, or None; ``facts`` gets the route,
    the variant count and the ``layout``."""
    shard_width = lm_head.num_embeddings_per_partition
    dtypes = logits_dtypes(processor, lm_head)
    if any(dtype not in LOGITS_DTYPES for dtype in dtypes):
        return f"SGLang's LM head can give {dtypes} logits; the partials take bf16 or fp32"
    try:
        layout = partials_layout(
            shard_width=shard_width,
            tp_rank=group.rank_in_group,
            tp_size=group.world_size,
            vocab_size=processor.vocab_size,
        )
    except (TypeError, ValueError) as exc:
        return f"the LM head's shard does not fit the exchange ({exc})"
    for probe_rows in sorted({1, max(rows)}):
        probe = torch.empty(
            exchange_shape(probe_rows, shard_width, group.world_size),
            dtype=torch.float32,
            device=lm_head.weight.device,
        )
        route, nccl = all_reduce_route(group, probe)
        facts["all-reduce"] = route
        if nccl:
            return (
                f"the exchange's all-reduce ({probe_rows} rows) would run on NCCL ({route}) "
                "inside the CUDA-graph capture"
            )
    try:
        variants = warm_up(
            rows=rows,
            shard_width=shard_width,
            tp_size=group.world_size,
            vocab_size=processor.vocab_size,
            dtypes=dtypes,
            device=lm_head.weight.device,
            draft_steps=draft_steps,
        )
    except Exception as exc:
        return f"compiling the exchange kernels ahead failed ({type(exc).__name__}: {exc})"
    facts["kernel variants compiled ahead"] = len(variants)
    facts["layout"] = layout
    return None


# --- the opt-in: the ranks agree, the state is set -----------------------------------------------


@dataclass
class Decision:
    """What one opt-in decided, and the facts it decided on (for its one log line). Each call
    site's subclass words the line: :meth:`on_line` and :meth:`off_line` of the joined facts."""

    reason: Optional[str] = None  # why SGLang's path is kept; None when the exchange engaged
    facts: dict = field(default_factory=dict)

    @property
    def engaged(self) -> bool:
        return self.reason is None

    def on_line(self, facts: str) -> str:
        raise NotImplementedError

    def off_line(self, facts: str) -> str:
        raise NotImplementedError

    def line(self) -> str:
        facts = ", ".join(f"{name} {value}" for name, value in self.facts.items())
        return self.on_line(facts) if self.engaged else self.off_line(facts)

    def log(self) -> None:
        """The decision at INFO, once per process for each distinct line."""
        line = self.line()
        log_once(logging.INFO, ("argmax-exchange-opt-in", line), "sglang_dsa_mtp: %s", line)


def agreed_blocker(lm_head, facts: dict, local_blocker) -> Optional[str]:
    """The collective half of both exchanges' opt-ins: this rank's answer of
    ``local_blocker(group, facts)`` (why it must keep SGLang's path, or None; a raise is an answer
    too), agreed across the TP group so that every rank decides the same; ``facts`` gets the TP
    size and the LM head's facts first. No TP group: why, without agreeing."""
    try:
        group = get_parallel().tp_group
    except Exception as exc:  # no TP group to exchange over, nor to agree with
        return f"no TP group ({type(exc).__name__}: {exc})"
    facts["tp size"] = group.world_size
    facts.update(head_facts(lm_head))
    try:
        reason = local_blocker(group, facts)
    except Exception as exc:  # never take the server down: SGLang's path stays
        reason = f"the opt-in check raised {type(exc).__name__}: {exc}"
    # Every rank gets here, whatever happened.
    return agree_across_group(group, reason)


def engage_processor(
    processor,
    lm_head,
    decision: Decision,
    local_blocker,
    slot: str,
    *,
    gather_rows: tuple[int, ...],
    gather_dtypes: Optional[tuple[torch.dtype, ...]] = None,
    cast: bool,
    what: str,
) -> Optional[Exchange]:
    """Decide ``decision`` (:func:`agreed_blocker` of ``local_blocker``) and set the processor's
    ``slot`` of its :class:`ProcessorState` (``"exchange"``: the draft's, ``"verify"``: the
    target's) to the engaged :class:`Exchange`, or None; returns it. Engaged, the processor's
    logits tail is run ahead (:func:`warm_up_gathers`: ``gather_rows``, ``gather_dtypes``, default
    :func:`logits_dtypes`, ``cast``), so that what it builds lazily is built before the first
    request."""
    decision.reason = agreed_blocker(lm_head, decision.facts, local_blocker)
    layout = decision.facts.pop("layout", None)
    exchange = None
    if decision.engaged:
        exchange = Exchange(lm_head, layout, decision.facts.get("all-reduce"))
    setattr(state_of(processor, ProcessorState), slot, exchange)
    if exchange is not None:
        dtypes = gather_dtypes or logits_dtypes(processor, lm_head)
        warm_up_gathers(processor, lm_head, gather_rows, dtypes, cast=cast, what=what)
    return exchange


def warm_up_gathers(processor, lm_head, rows, dtypes, *, cast: bool, what: str) -> bool:
    """Run the processor's logits tail on zero shards at each of ``rows`` and ``dtypes``, on every
    rank in lockstep (:func:`agreed_warm_up`): its gather at TP > 1 (SGLang's multimem all-gather
    builds its symmetric-memory buffer on its first eager call) and, with ``cast``, its cast into
    an fp32 buffer (SGLang's gather and cast kernels compile per row-count class)."""
    shard_width, device = lm_head.num_embeddings_per_partition, lm_head.weight.device

    def step(dtype, count):
        def prepare():
            shard = torch.zeros((count, shard_width), dtype=dtype, device=device)
            if not cast:
                return lambda: processor._logits_gatherer(shard)
            buffer = torch.empty((count, processor.vocab_size), dtype=BUFFER_DTYPE, device=device)
            return lambda: gather_and_cast(processor, shard, buffer)

        return prepare

    return agreed_warm_up([step(dtype, count) for dtype in dtypes for count in rows], what)


def agreed_warm_up(steps: Iterable[Callable[[], Callable[[], object]]], what: str) -> bool:
    """Run collective warm-up ``steps`` on every rank of the TP group in lockstep; whether all ran.

    Each step prepares this rank's inputs (local work, which may fail on one rank alone) and returns
    the collective to run on them. Before each collective the ranks agree that every rank prepared
    its inputs, and after the last one that every collective ran: a failure on any rank stops every
    rank before the same collective, so that none is left waiting in a gather the others never
    join. A failure is logged once (WARNING) on every rank, naming ``what`` was left undone."""
    group = get_parallel().tp_group
    reason = None
    for step in steps:
        try:
            collective = step()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        reason = _agreed(group, reason)
        if reason is not None:
            break
        try:
            collective()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    reason = _agreed(group, reason)
    if reason is not None:
        log_once(
            logging.WARNING,
            ("exchange-warm-up", what, reason),
            "sglang_dsa_mtp: preparing %s ahead failed (%s); its first call builds it instead",
            what,
            reason,
        )
    return reason is None


def _agreed(group, reason: Optional[str]) -> Optional[str]:
    agreed = agree_across_group(group, reason)
    if reason is None and agreed is not None:
        return "it failed on another TP rank (its reason is in its log)"
    return agreed


# --- the target verify's kept shard, inside SGLang's logits buffer -------------------------------


def kept_bytes_per_row(width: int, dtype: torch.dtype) -> int:
    """The bytes one kept row takes: its shard row and its picked token."""
    return width * dtype.itemsize + TOKEN_DTYPE.itemsize


def kept_fit_blocker(processor, lm_head) -> Optional[str]:
    """Why a kept shard row and its token would not fit one row of SGLang's fp32 logits buffer for
    some logits dtype of this head (an fp32 shard at TP 1), or None."""
    width, buffer_row = lm_head.num_embeddings_per_partition, processor.vocab_size * 4
    for dtype in logits_dtypes(processor, lm_head):
        if kept_bytes_per_row(width, dtype) > buffer_row:
            return (
                f"a {str(dtype).removeprefix('torch.')} shard row of {width} columns and its token "
                f"do not fit a {processor.vocab_size}-column fp32 row of SGLang's logits buffer"
            )
    return None


@dataclass(frozen=True)
class KeptShard:
    """Where a logits buffer's storage holds kept shards: the processor, the shard rows'
    ``width`` and ``dtype``, ``capacity`` rows (the storage's fp32 rows), ``tokens`` (int64
    ``[capacity, 1]``, the picked token of each row) and ``logits_buffer`` (the whole storage as
    SGLang's fp32 ``[capacity, vocab]``, where the full logits are cast)."""

    processor: object
    width: int
    dtype: torch.dtype
    capacity: int
    tokens: torch.Tensor
    logits_buffer: torch.Tensor


@dataclass(frozen=True)
class _Placement:
    processor: object
    width: int
    dtype: torch.dtype
    capacity: int

    def tokens_offset(self) -> int:
        """The tokens' first element (int64) in the storage: after the shard of ``capacity`` rows,
        so that every row count finds its rows' shard and tokens at the same place."""
        shard_bytes = self.capacity * self.width * self.dtype.itemsize
        return -(-shard_bytes // TOKEN_DTYPE.itemsize)

    def fits(self, nbytes: int) -> bool:
        return (self.tokens_offset() + self.capacity) * TOKEN_DTYPE.itemsize <= nbytes

    def view(self, storage, dtype, offset: int, shape) -> torch.Tensor:
        tensor = torch.empty(0, dtype=dtype, device=storage.device)
        return tensor.set_(storage, offset, shape, (shape[1], 1))

    def kept(self, storage) -> KeptShard:
        vocab = self.processor.vocab_size
        tokens = self.view(storage, TOKEN_DTYPE, self.tokens_offset(), (self.capacity, 1))
        buffer = self.view(storage, BUFFER_DTYPE, 0, (self.capacity, vocab))
        return KeptShard(self.processor, self.width, self.dtype, self.capacity, tokens, buffer)


# Every logits buffer storage that holds kept shards, for as long as it lives (a CUDA graph's
# output is a view of it; SGLang's shared logits buffer lives for the process). The weak reference
# pins the storage's identity, so a new tensor at a freed storage's address is never taken for it.
_KEPT: dict[StorageWeakRef, _Placement] = {}


def buffer_blocker(buffer, rows: int, vocab: int, device) -> Optional[str]:
    """Why ``buffer`` (the call's ``next_token_logits_buffer``) cannot hold this call's kept shard
    and tokens, or None: it must be SGLang's fp32 ``[rows, vocab]`` buffer, on the shard's device,
    starting a storage of whole fp32 rows."""
    if buffer is None:
        return "the call has no logits buffer (an eager target verify, or use_logits_buffer off)"
    if buffer.dtype != BUFFER_DTYPE or buffer.device != torch.device(device):
        return f"the logits buffer is {buffer.dtype} on {buffer.device}"
    if tuple(buffer.shape) != (rows, vocab) or not buffer.is_contiguous():
        return f"the logits buffer is {tuple(buffer.shape)}, not the call's contiguous {rows} rows"
    if buffer.storage_offset() != 0 or buffer.untyped_storage().nbytes() % (vocab * 4):
        return "the logits buffer does not start a storage of whole fp32 rows"
    return None


def keep_in_buffer(
    processor, shard: torch.Tensor, buffer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy ``shard`` (``[rows, width]``) into the storage of ``buffer`` (checked by
    :func:`buffer_blocker`), at the same place for every row count; returns ``(kept, tokens)``:
    the kept shard, a ``[rows, width]`` view of that storage that :func:`kept_shard_of` maps back,
    and the int64 ``[rows, 1]`` view of it where the rows' picked tokens go."""
    storage = buffer.untyped_storage()
    rows, width = shard.shape
    capacity = storage.nbytes() // (processor.vocab_size * 4)
    place = _Placement(processor, width, shard.dtype, capacity)
    if not place.fits(storage.nbytes()):  # kept_fit_blocker rules this out at the opt-in
        raise ValueError(f"{capacity} kept rows of {width} columns do not fit the logits buffer")
    key = StorageWeakRef(storage)
    if _KEPT.get(key) != place:
        for stale in [k for k in _KEPT if k.expired()]:
            del _KEPT[stale]
        _KEPT[key] = place
    kept = place.view(storage, shard.dtype, 0, (rows, width))
    kept.copy_(shard)
    return kept, place.view(storage, TOKEN_DTYPE, place.tokens_offset(), (rows, 1))


def kept_shard_of(logits) -> Optional[tuple[KeptShard, int]]:
    """``(kept, first_row)`` when ``logits`` is a kept shard (:func:`keep_in_buffer`) or a row
    slice of one (as SGLang's graph runner hands it on: ``[: raw rows]``), else None (real
    logits, including SGLang's own in the same buffer, None, anything else)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.is_meta:
        return None
    storage = logits.untyped_storage()
    place = _KEPT.get(StorageWeakRef(storage))
    if (
        place is None
        or logits.dtype != place.dtype
        or logits.shape[1] != place.width
        or logits.stride() != (place.width, 1)
        or logits.storage_offset() % place.width
    ):
        return None
    return place.kept(storage), logits.storage_offset() // place.width


def full_logits(kept: KeptShard, start: int, rows: torch.Tensor) -> torch.Tensor:
    """SGLang's verify logits of the kept shard ``rows`` (from row ``start``): the processor's own
    logits all-gather of them (at TP > 1) and its ``_copy_logits_to_buffer`` into those rows of the
    fp32 logits buffer the shard lives in, as SGLang's ``_get_logits`` ends a call without
    softcapping. At TP 1 the rows are copied out first: the cast writes over the shard it reads
    (a copy no larger than the transient SGLang's own call allocates)."""
    if not kept.processor.do_tensor_parallel_all_gather:
        rows = rows.clone()
    return gather_and_cast(kept.processor, rows, kept.logits_buffer[start : start + rows.shape[0]])


def gather_and_cast(processor, shard_rows: torch.Tensor, buffer: Optional[torch.Tensor]):
    """The tail of SGLang's ``_get_logits`` in target verify: the processor's logits gather (at
    TP > 1), then its ``_copy_logits_to_buffer`` into ``buffer``."""
    logits = shard_rows
    if processor.do_tensor_parallel_all_gather:
        logits = processor._logits_gatherer(shard_rows)
    metadata = LogitsMetadata(
        forward_mode=ForwardMode.TARGET_VERIFY, next_token_logits_buffer=buffer
    )
    return processor._copy_logits_to_buffer(logits, metadata)
