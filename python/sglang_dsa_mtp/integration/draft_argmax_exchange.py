"""Hook site: a draft model's ``LogitsProcessor``, greedy drafts exchanging argmax partials.

Where SGLang 0.5.23's ``LogitsProcessor._get_logits`` all-gathers ``rows x vocab`` logits only for a
greedy (topk=1) EAGLE draft's argmax, an opted-in processor reduces its LM-head shard to argmax
partials (``draft_argmax_partials``) summed by SGLang's own TP all-reduce: in draft decode and the
graph draft extend only; every other call keeps the gather (the target model's processor is
``verify_argmax_exchange``'s, whose ``_get_logits`` hook hands every other call here). The opt-in,
``enable_draft_argmax_exchange(lm_head)`` (added to the class), engages only where SGLang's LM-head
path is a plain bf16/fp32 matmul over the rank's vocab shard, and runs every check, the ranks
agreeing; the per-step hooks check nothing and have no fallback. Hooks: AROUND ``_get_logits``
(:func:`exchange_instead_of_gather`, reached through ``verify_argmax_exchange.exchange_logits``),
AFTER ``forward`` (sets ``next_token_argmax_partials``; ``next_token_logits`` is then a zero-stride
view of the exchange, not logits: see :func:`exchange_of`). Details: docs/switches.md, section
"Greedy-draft argmax exchange".
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from sglang.srt.runtime_context import get_parallel

from sglang_dsa_mtp.integration.state import ProcessorState, peek
from sglang_dsa_mtp.integration.vocab_shard_exchange import (
    Decision,
    Exchange,
    engage_processor,
    lm_head_blocker,
    shard_exchange_blocker,
)
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import MAX_VOCAB, launch_partials
from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE

NO_PARTIALS = None  # LogitsProcessorOutput.next_token_argmax_partials everywhere else
DEFAULT_MAX_ROWS = 256

# Every live exchange buffer we handed out behind a stand-in, by the address of its storage. Weak:
# an entry goes with its buffer, which its stand-in keeps alive. (A view's ``_base`` would not do:
# inference mode, which SGLang's scheduler may run under, records no base for views.)
_EXCHANGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def stand_in_logits(exchange: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A zero-stride ``[rows, vocab_size]`` view of ``exchange`` (no logits, no memory).

    ``exchange`` must be contiguous and start its storage (a fresh buffer)."""
    _EXCHANGES[exchange.untyped_storage().data_ptr()] = exchange
    stand_in = exchange[:, :1].expand(exchange.shape[0], vocab_size)
    stand_in._sglang_dsa_mtp_exchange = exchange  # keeps the registry entry alive with the view
    return stand_in


def exchange_of(logits: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The exchange buffer rows behind a :func:`stand_in_logits` view (or a row slice of one), else
    None: real logits, None, anything else."""
    if logits is None or logits.dim() != 2 or logits.stride(1) != 0:
        return None
    exchange = _EXCHANGES.get(logits.untyped_storage().data_ptr())
    if exchange is None:
        return None
    start = logits.storage_offset() // exchange.stride(0)
    return exchange[start : start + logits.shape[0]]


def exchange_state(processor) -> Optional[Exchange]:
    """The processor's engaged exchange, or None (not opted in, or kept the gather)."""
    return peek(processor, ProcessorState).exchange


def _processor_blocker(processor) -> Optional[str]:
    if not processor.do_tensor_parallel_all_gather:
        return "the processor does not gather logits across TP ranks (tp size 1 or skip_all_gather)"
    if processor.use_attn_tp_group:
        return "DP LM head (--enable-dp-lm-head) gathers over the attention-TP group"
    if processor.do_tensor_parallel_all_gather_dp_attn:
        return "DP attention gathers hidden states across DP ranks"
    if processor.use_tp_lm_head_all_to_all:
        return "the TP LM-head all-to-all (--enable-tp-lm-head-all-to-all) owns the layout"
    if processor.final_logit_softcapping:
        return "final-logit softcapping gathers fp32 logits and caps them (fused gather kept)"
    if not 1 <= processor.vocab_size <= MAX_VOCAB:
        return f"vocab size {processor.vocab_size} is outside 1..{MAX_VOCAB}"
    return None


class ExchangeDecision(Decision):
    """What one draft opt-in decided, and the facts it decided on (for its one log line)."""

    def on_line(self, facts: str) -> str:
        return f"draft_argmax_exchange on: greedy draft exchanges argmax partials ({facts})"

    def off_line(self, facts: str) -> str:
        return (
            f"draft_argmax_exchange off: greedy draft keeps the logits gather: {self.reason} "
            f"({facts})"
        )


def _local_blocker(
    processor, lm_head, group, max_rows: int, capture_rows, draft_steps, facts: dict
) -> Optional[str]:
    """Why this rank must keep the gather, or None, before the ranks agree; ``facts`` gets the
    all-reduce route, the kernel variants compiled ahead and the shard's checked ``layout``."""
    # The switch alone: the partials run wherever Triton does (the draft worker, which opts its
    # processor in, asks the platform: its topk=1 paths are CUDA's).
    enabled, why = DRAFT_ARGMAX_EXCHANGE.state()
    reason = (
        (None if enabled else why)
        or _processor_blocker(processor)
        or lm_head_blocker(lm_head, group)
    )
    if reason is not None:
        return reason
    rows = sorted({1, max(1, int(max_rows)), *(int(r) for r in capture_rows or ())})
    return shard_exchange_blocker(processor, lm_head, group, rows, facts, draft_steps=draft_steps)


def opt_in(
    processor,
    lm_head,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    capture_rows=None,
    draft_steps: Optional[int] = None,
    facts: Optional[dict] = None,
) -> ExchangeDecision:
    """The collective opt-in of :func:`enable_draft_argmax_exchange`, without logging: engages
    ``processor`` (or leaves it gathering) and returns the decision with its facts, after
    ``facts`` (the caller's, first in the line)."""
    decision = ExchangeDecision(facts=dict(facts or {}))

    def local_blocker(group, facts):
        return _local_blocker(processor, lm_head, group, max_rows, capture_rows, draft_steps, facts)

    # SGLang's MultimemAllGatherer builds its symmetric-memory buffer (max tokens x vocab) on its
    # first eager call; without the exchange that is a draft-decode capture warm-up at start-up.
    # With it, draft decode no longer gathers, and the first gather would be the first draft
    # prefill while serving: an unplanned collective allocation there. So it runs once now.
    fp32 = processor.use_fp32_lm_head or processor.use_fp32_lm_head_output
    engage_processor(
        processor,
        lm_head,
        decision,
        local_blocker,
        "exchange",
        gather_rows=(1,),
        gather_dtypes=(torch.float32 if fp32 else lm_head.weight.dtype,),
        cast=False,
        what="the draft logits gather",
    )
    return decision


def enable_draft_argmax_exchange(
    self,
    lm_head,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    capture_rows=None,
    draft_steps: Optional[int] = None,
) -> bool:
    """Opt this (draft model's) ``LogitsProcessor`` in to the greedy-draft argmax exchange.

    ``lm_head`` is the head the model passes to ``forward``; ``max_rows`` the most rows one call
    has (the largest captured batch); ``capture_rows`` the row counts of the captured graphs and
    ``draft_steps`` the draft-token columns the draft decode pick writes, both for compiling the
    kernels ahead (optional). Engages, and returns True, only when every condition holds: the kill
    switch is on; the processor gathers vocab-parallel logits over the TP group (tp > 1, no DP
    attention, no DP LM head, no LM-head all-to-all, no final-logit softcapping); SGLang's LM-head
    path for ``lm_head`` is a plain bf16/fp32 matmul (a ``ParallelLMHead`` whose quant method, if
    any, SGLang does not apply, no LoRA, no bias, no added vocab, rank r owning the r-th contiguous
    shard); SGLang's TP all-reduce of the exchange buffer, for 1 and ``max_rows`` rows, would not
    run on NCCL inside a CUDA-graph capture; and every kernel variant compiled ahead (scratch
    tensors only). Otherwise the processor keeps the gather. The decision and its facts are logged
    once at INFO. Collective: call it on every rank of the TP group, which settles on one answer
    for all ranks.
    """
    decision = opt_in(
        self, lm_head, max_rows=max_rows, capture_rows=capture_rows, draft_steps=draft_steps
    )
    decision.log()
    return decision.engaged


def _exchange_applies(state, lm_head, logits_metadata, embedding_bias) -> bool:
    if state is None or lm_head is not state.lm_head or embedding_bias is not None:
        return False
    if logits_metadata.extend_return_logprob:
        return False
    mode = logits_metadata.forward_mode
    if mode.is_decode():
        return True
    return mode.is_draft_extend_v2() and logits_metadata.draft_extend_select_index is not None


def exchange_instead_of_gather(
    original, self, hidden_states, lm_head, logits_metadata, embedding_bias=None, **kwargs
):
    """AROUND ``LogitsProcessor._get_logits``: for an engaged processor's greedy-draft calls, the
    all-reduced argmax partials behind a stand-in view instead of the gathered logits."""
    state = peek(self, ProcessorState).exchange
    if not _exchange_applies(state, lm_head, logits_metadata, embedding_bias):
        return original(self, hidden_states, lm_head, logits_metadata, embedding_bias, **kwargs)
    logits = self._compute_lm_head(hidden_states, lm_head, None)
    if self.logit_scale is not None:
        logits.mul_(self.logit_scale)
    exchange = get_parallel().tp_group.all_reduce(launch_partials(state.layout, logits))
    if exchange.storage_offset() != 0 or not exchange.is_contiguous():
        exchange = exchange.clone()  # an all-reduce that returned a view: own the rows
    return stand_in_logits(exchange, self.vocab_size)


def attach_partials(result, self, *args, **kwargs):
    """AFTER ``LogitsProcessor.forward``: name the exchange buffer in the output when there is one."""
    if peek(self, ProcessorState).exchange is not None and result is not None:
        exchange = exchange_of(result.next_token_logits)
        if exchange is not None:
            result.next_token_argmax_partials = exchange
    return result
