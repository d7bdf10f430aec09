"""Hook site: the EAGLE target model's ``LogitsProcessor`` in target verify, keeping its vocab shard
and exchanging argmax partials instead of gathering the logits (beyond the spec).

In SGLang 0.5.23 the target verify all-gathers ``rows x vocab`` logits over the TP ranks inside the
target-verify CUDA graph and casts them into its fp32 logits buffer; the EAGLE verify of a greedy
batch then reads them once, for an argmax. An opted-in target processor (:func:`opt_in`, called by
the EAGLE worker's opt-in in ``eagle_verify_argmax``) keeps its LM-head shard instead and, inside
the graph, reduces it to the greedy draft exchange's argmax partials, sums them with SGLang's TP
all-reduce and finalizes with the ``propagate`` rule (``torch.argmax``'s: ties to the lowest index,
the first NaN wins): :func:`keep_shard` returns the shard as ``next_token_logits`` and records it
with the picked tokens (:class:`KeptShard`, found again from the shard or a row slice of it by
:func:`kept_shard_of`). After the replay, the verify of a greedy batch reads the tokens; any other
batch gets :func:`full_logits`, SGLang's own gather and cast of the kept shard rows, bit-identical to
what the graph writes without the plugin.

Hook: AROUND ``LogitsProcessor._get_logits`` (:func:`exchange_logits`), the one hook of that method
for both exchanges: the target verify of an engaged target processor here, every other call on to
the draft exchange's ``exchange_instead_of_gather`` (which leaves what is not its own to SGLang).
The opt-in runs every check and compiles every kernel variant, the ranks agreeing; the per-call path
checks nothing. Details: docs/switches.md, "Greedy target-verify argmax exchange".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.layers.logits_processor import LogitsMetadata
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from torch.multiprocessing.reductions import StorageWeakRef

from sglang_dsa_mtp.integration.draft_argmax_exchange import (
    ExchangeDecision,
    agreed_blocker,
    exchange_instead_of_gather,
    lm_head_blocker,
    logits_dtypes,
    shard_exchange_blocker,
)
from sglang_dsa_mtp.integration.state import ProcessorState, peek, state_of
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
    MAX_VOCAB,
    PartialsLayout,
    launch_finalize,
    launch_partials,
)
from sglang_dsa_mtp.log import log_once
from sglang_dsa_mtp.switches import VERIFY_ARGMAX_EXCHANGE

DEFAULT_MAX_ROWS = 256
# The full-logits tail (SGLang's gather and cast of the kept rows) is compiled ahead at one row count
# of each class Triton specializes an integer argument on: 1, a multiple of 16, any other.
FULL_LOGITS_WARM_UP_ROWS = (1, 3, 16)


@dataclass(frozen=True)
class VerifyExchange:
    """An engaged target processor's exchange: its LM head, its shard's checked layout, the route."""

    lm_head: torch.nn.Module
    layout: PartialsLayout
    route: str


@dataclass(frozen=True)
class KeptShard:
    """What one target-verify call kept: the processor, the LM-head shard's ``[rows, width]``, the
    tokens the finalize picked for those rows (int64 ``[rows, 1]``) and the fp32 logits buffer
    SGLang's call would have cast the gathered logits into (None where it had none)."""

    processor: object
    rows: int
    width: int
    tokens: torch.Tensor
    logits_buffer: Optional[torch.Tensor]


# Every kept shard, by its storage, for as long as that storage lives: a CUDA graph's output holds
# its shard for the graph's life, so its entry stays; an eager call's entry is dropped at a later
# registration once its shard is freed. The weak reference pins the storage's identity, so a new
# tensor at a freed shard's address is never taken for it.
_KEPT: dict[StorageWeakRef, KeptShard] = {}


def verify_state(processor) -> Optional[VerifyExchange]:
    """The processor's engaged target-verify exchange, or None (not opted in, or kept the gather)."""
    return peek(processor, ProcessorState).verify


def _remember(shard: torch.Tensor, kept: KeptShard) -> None:
    for key in [key for key in _KEPT if key.expired()]:
        del _KEPT[key]
    _KEPT[StorageWeakRef(shard.untyped_storage())] = kept


def kept_shard_of(logits) -> Optional[tuple[KeptShard, int]]:
    """``(kept, first_row)`` when ``logits`` is a kept shard or a row slice of one (as SGLang's
    graph runner hands it on: ``[: raw rows]``), else None. Raises on any other view of a kept
    shard: it holds no logits SGLang could read."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.is_meta:
        return None
    kept = _KEPT.get(StorageWeakRef(logits.untyped_storage()))
    if kept is None:
        return None
    start, rem = divmod(logits.storage_offset(), kept.width)
    if logits.stride() != (kept.width, 1) or logits.shape[1] != kept.width or rem:
        raise RuntimeError(
            f"a {tuple(logits.shape)} view with strides {logits.stride()} of a kept target-verify "
            f"shard [{kept.rows}, {kept.width}]: only its row slices stand for the verify logits"
        )
    return kept, start


def keep_shard(processor, state: VerifyExchange, hidden_states, lm_head, logits_buffer):
    """The target-verify call of an engaged processor: this rank's LM-head shard (SGLang's
    ``_compute_lm_head``, then its ``logit_scale``), its argmax partials, SGLang's TP all-reduce
    of them and the ``propagate`` finalize; returns the shard, remembered with the tokens."""
    shard = processor._compute_lm_head(hidden_states, lm_head, None)
    if processor.logit_scale is not None:
        shard.mul_(processor.logit_scale)
    exchange = launch_partials(state.layout, shard)
    if state.layout.tp_size > 1:
        exchange = get_parallel().tp_group.all_reduce(exchange)
    _, tokens = launch_finalize(exchange, propagate_nan=True)
    _remember(shard, KeptShard(processor, shard.shape[0], shard.shape[1], tokens, logits_buffer))
    return shard


def full_logits(kept: KeptShard, start: int, rows: torch.Tensor) -> torch.Tensor:
    """SGLang's verify logits of the kept shard ``rows`` (from row ``start``): the processor's own
    logits all-gather of them (at TP > 1) and its ``_copy_logits_to_buffer`` into those rows of the
    call's fp32 logits buffer, as SGLang's ``_get_logits`` ends a call without softcapping."""
    buffer = kept.logits_buffer
    if buffer is not None:
        buffer = buffer[start : start + rows.shape[0]]
    return _gather_and_cast(kept.processor, rows, buffer)


def _gather_and_cast(processor, shard_rows: torch.Tensor, buffer: Optional[torch.Tensor]):
    logits = shard_rows
    if processor.do_tensor_parallel_all_gather:
        logits = processor._logits_gatherer(shard_rows)
    metadata = LogitsMetadata(
        forward_mode=ForwardMode.TARGET_VERIFY, next_token_logits_buffer=buffer
    )
    return processor._copy_logits_to_buffer(logits, metadata)


def exchange_logits(
    original, self, hidden_states, lm_head, logits_metadata, embedding_bias=None, **kwargs
):
    """AROUND ``LogitsProcessor._get_logits``: an engaged target processor's target verify keeps
    its shard (:func:`keep_shard`); every other call goes on to the draft exchange's hook."""
    state = peek(self, ProcessorState).verify
    if (
        state is not None
        and lm_head is state.lm_head
        and embedding_bias is None
        and logits_metadata.forward_mode.is_target_verify()
        and not logits_metadata.extend_return_logprob
    ):
        use_buffer = kwargs.get("use_logits_buffer", True)
        buffer = logits_metadata.next_token_logits_buffer if use_buffer else None
        return keep_shard(self, state, hidden_states, lm_head, buffer)
    return exchange_instead_of_gather(
        original, self, hidden_states, lm_head, logits_metadata, embedding_bias, **kwargs
    )


# --- the opt-in ----------------------------------------------------------------------------------


class VerifyDecision(ExchangeDecision):
    """What one target opt-in decided, and the facts it decided on (for its one log line)."""

    def line(self) -> str:
        facts = ", ".join(f"{name} {value}" for name, value in self.facts.items())
        if self.engaged:
            return (
                "verify_argmax_exchange on: greedy target verify takes its argmax from exchanged "
                f"argmax partials ({facts})"
            )
        return (
            f"verify_argmax_exchange off: target verify keeps SGLang's full logits: {self.reason} "
            f"({facts})"
        )


def _processor_blocker(processor, tp_size: int) -> Optional[str]:
    if processor.use_attn_tp_group:
        return "DP LM head (--enable-dp-lm-head) gathers over the attention-TP group"
    if processor.do_tensor_parallel_all_gather_dp_attn:
        return "DP attention gathers hidden states across DP ranks"
    if processor.use_tp_lm_head_all_to_all:
        return "the TP LM-head all-to-all (--enable-tp-lm-head-all-to-all) owns the layout"
    if tp_size > 1 and not processor.do_tensor_parallel_all_gather:
        return "the processor does not gather its vocab shards (skip_all_gather)"
    if processor.final_logit_softcapping:
        return "final-logit softcapping: SGLang gathers fp32 logits and caps them in a fused kernel"
    if tp_size == 1 and (processor.use_fp32_lm_head or processor.use_fp32_lm_head_output):
        return "at TP 1 SGLang's fp32 LM head writes its logits into the fp32 buffer itself"
    if not 1 <= processor.vocab_size <= MAX_VOCAB:
        return f"vocab size {processor.vocab_size} is outside 1..{MAX_VOCAB}"
    return None


def _local_blocker(processor, lm_head, group, rows: list[int], facts: dict) -> Optional[str]:
    """Why this rank must keep SGLang's full logits, or None, before the ranks agree; ``facts``
    gets the all-reduce route, the kernel variants compiled ahead and the shard's ``layout``."""
    enabled, why = VERIFY_ARGMAX_EXCHANGE.state()
    reason = (
        (None if enabled else why)
        or _processor_blocker(processor, group.world_size)
        or lm_head_blocker(lm_head, group)
    )
    if reason is not None:
        return reason
    return shard_exchange_blocker(processor, lm_head, group, rows, facts)


def opt_in(
    processor,
    lm_head,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    capture_rows=None,
    facts: Optional[dict] = None,
) -> VerifyDecision:
    """Opt the target model's ``processor`` in to the target-verify exchange, or leave it on
    SGLang's path; returns the decision with its facts (after ``facts``, the caller's), unlogged.

    ``lm_head`` is the head the model passes to ``forward``; ``max_rows`` the most rows one
    target-verify call has in a CUDA graph (largest captured batch x draft tokens); ``capture_rows``
    the captured row counts. Engages only when every condition holds: the kill switch is on; no DP
    LM head, DP attention, LM-head all-to-all or final-logit softcapping, a processor that gathers
    its vocab shards at TP > 1, no fp32 LM head at TP 1; SGLang's LM-head path for ``lm_head`` a
    plain bf16/fp32 matmul over the rank's contiguous vocab shard (the draft exchange's rule); at
    TP > 1 SGLang's all-reduce of the exchange buffer, for 1 and ``max_rows`` rows, not on NCCL
    inside a CUDA-graph capture; every kernel variant compiled ahead. Collective: call it on every
    rank of the TP group, which settles on one answer. Engaging also runs the full-logits tail once
    per row-count class (SGLang's gather, a collective, and its cast), so that its buffers and
    kernels exist before the first request."""
    decision = VerifyDecision(facts=dict(facts or {}))
    rows = sorted({1, max(1, int(max_rows)), *(int(r) for r in capture_rows or ())})

    def local_blocker(group, facts):
        facts["verify rows up to"] = max(rows)
        return _local_blocker(processor, lm_head, group, rows, facts)

    decision.reason = agreed_blocker(lm_head, decision.facts, local_blocker)
    layout = decision.facts.pop("layout", None)
    state = state_of(processor, ProcessorState)
    if not decision.engaged:
        state.verify = None
        return decision
    state.verify = VerifyExchange(lm_head, layout, decision.facts.get("all-reduce"))
    _warm_up_full_logits(processor, lm_head)
    return decision


def _warm_up_full_logits(processor, lm_head) -> None:
    """Run the full-logits tail on zero shards, on every rank (all engaged together), at each row
    count of :data:`FULL_LOGITS_WARM_UP_ROWS` and logits dtype: SGLang's multimem all-gather builds
    its symmetric-memory buffer on its first eager call (in SGLang a target-verify capture warm-up,
    which no longer gathers) and its gather and cast kernels compile per row-count class. A failure
    is logged and leaves them to their first non-greedy verify."""
    shard_width, device = lm_head.num_embeddings_per_partition, lm_head.weight.device
    try:
        for dtype in logits_dtypes(processor, lm_head):
            for rows in FULL_LOGITS_WARM_UP_ROWS:
                shard = torch.zeros((rows, shard_width), dtype=dtype, device=device)
                buffer = torch.empty(
                    (rows, processor.vocab_size), dtype=torch.float32, device=device
                )
                _gather_and_cast(processor, shard, buffer)
    except Exception as exc:
        log_once(
            logging.WARNING,
            ("verify-exchange-warm-up", type(exc).__name__),
            "sglang_dsa_mtp: preparing the target verify's full-logits path ahead failed (%s: %s); "
            "its first non-greedy verify builds it instead",
            type(exc).__name__,
            exc,
        )
