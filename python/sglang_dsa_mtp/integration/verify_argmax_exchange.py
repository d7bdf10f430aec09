"""Hook site: the EAGLE target model's ``LogitsProcessor`` in target verify, keeping its vocab shard
and exchanging argmax partials instead of gathering the logits (beyond the spec).

In SGLang 0.5.23 the target verify all-gathers ``rows x vocab`` logits over the TP ranks inside the
target-verify CUDA graph and casts them into its fp32 logits buffer (at TP 1 the cast alone); the
EAGLE verify of a greedy batch then reads them once, for an argmax. An opted-in target processor
(:func:`opt_in`, called by the EAGLE worker's opt-in in ``eagle_verify_argmax``) keeps its LM-head
shard instead and, inside the graph, reduces it to argmax partials (``vocab_shard_exchange``), sums
them with SGLang's TP all-reduce and finalizes with the ``propagate`` rule (``torch.argmax``'s: ties
to the lowest index, the first NaN wins). :func:`keep_shard` copies the shard and the picked tokens
into the storage of the call's fp32 logits buffer, which SGLang shares between every captured
graph (so a graph keeps no memory of its own), and returns the kept shard as
``next_token_logits``; ``kept_shard_of`` finds it again from the shard or a row slice of it. After
the replay, the verify of a greedy batch reads the tokens; any other batch gets
``full_logits``, SGLang's own gather and cast of the kept shard rows into that buffer,
bit-identical to what the graph writes without the plugin. A call without a usable buffer (an eager
target verify: SGLang's runners give one only to captured graphs) keeps SGLang's path.

Hook: AROUND ``LogitsProcessor._get_logits`` (:func:`exchange_logits`), the one hook of that method
for both exchanges: the target verify of an engaged target processor here, every other call on to
the draft exchange's ``exchange_instead_of_gather`` (which leaves what is not its own to SGLang).
The opt-in runs every check and compiles every kernel variant, the ranks agreeing; the per-call path
checks only the call's buffer. Details: docs/switches.md, "Greedy target-verify argmax exchange".
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from sglang.srt.runtime_context import get_parallel

from sglang_dsa_mtp.integration.draft_argmax_exchange import exchange_instead_of_gather
from sglang_dsa_mtp.integration.state import ProcessorState, peek
from sglang_dsa_mtp.integration.vocab_shard_exchange import (
    Decision,
    Exchange,
    buffer_blocker,
    engage_processor,
    keep_in_buffer,
    kept_fit_blocker,
    lm_head_blocker,
    shard_exchange_blocker,
)
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
    MAX_VOCAB,
    launch_finalize,
    launch_partials,
)
from sglang_dsa_mtp.log import log_once
from sglang_dsa_mtp.switches import VERIFY_ARGMAX_EXCHANGE

DEFAULT_MAX_ROWS = 256
# The full-logits tail (SGLang's gather and cast of the kept rows) is compiled ahead at one row count
# of each class Triton specializes an integer argument on: 1, a multiple of 16, any other.
FULL_LOGITS_WARM_UP_ROWS = (1, 3, 16)


def verify_state(processor) -> Optional[Exchange]:
    """The processor's engaged target-verify exchange, or None (not opted in, or kept the gather)."""
    return peek(processor, ProcessorState).verify


def keep_shard(processor, state: Exchange, hidden_states, lm_head, logits_buffer) -> torch.Tensor:
    """The target-verify call of an engaged processor: this rank's LM-head shard (SGLang's
    ``_compute_lm_head``, then its ``logit_scale``) kept in ``logits_buffer``'s storage
    (``keep_in_buffer``), its argmax partials, SGLang's TP all-reduce of them and the
    ``propagate`` finalize, whose tokens are kept beside it; returns the kept shard.

    The shard is SGLang's own output copied, not a matmul into the buffer: bit for bit SGLang's
    whichever LM-head branch it takes. The copy is no larger than the transient SGLang's own call
    allocates for the same output before its gather and cast, and it is freed before the partials
    are allocated, so the call's peak stays at most SGLang's."""
    shard = processor._compute_lm_head(hidden_states, lm_head, None)
    if processor.logit_scale is not None:
        shard.mul_(processor.logit_scale)
    kept, tokens = keep_in_buffer(processor, shard, logits_buffer)
    del shard
    exchange = launch_partials(state.layout, kept)
    if state.layout.tp_size > 1:
        exchange = get_parallel().tp_group.all_reduce(exchange)
    tokens.copy_(launch_finalize(exchange, propagate_nan=True)[1])
    return kept


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
        buffer = logits_metadata.next_token_logits_buffer
        if not kwargs.get("use_logits_buffer", True):
            buffer = None
        rows = hidden_states.shape[0]
        why = buffer_blocker(buffer, rows, self.vocab_size, state.lm_head.weight.device)
        if why is None:
            return keep_shard(self, state, hidden_states, lm_head, buffer)
        log_once(
            logging.INFO,
            ("verify-exchange-no-buffer", why),
            "sglang_dsa_mtp: verify_argmax_exchange: a target verify keeps SGLang's full logits: %s",
            why,
        )
        return original(self, hidden_states, lm_head, logits_metadata, embedding_bias, **kwargs)
    return exchange_instead_of_gather(
        original, self, hidden_states, lm_head, logits_metadata, embedding_bias, **kwargs
    )


# --- the opt-in ----------------------------------------------------------------------------------


class VerifyDecision(Decision):
    """What one target opt-in decided, and the facts it decided on (for its one log line)."""

    def on_line(self, facts: str) -> str:
        return (
            "verify_argmax_exchange on: greedy target verify takes its argmax from exchanged "
            f"argmax partials ({facts})"
        )

    def off_line(self, facts: str) -> str:
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
        or kept_fit_blocker(processor, lm_head)
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
    plain bf16/fp32 matmul over the rank's contiguous vocab shard (the draft exchange's rule); a kept
    shard row and its token within a row of SGLang's fp32 logits buffer (not an fp32 shard at TP
    1); at
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

    engage_processor(
        processor,
        lm_head,
        decision,
        local_blocker,
        "verify",
        gather_rows=FULL_LOGITS_WARM_UP_ROWS,
        cast=True,
        what="the target verify's full-logits path",
    )
    return decision
