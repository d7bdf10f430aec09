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

import logging
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from sglang.srt.layers import logits_processor as sglang_logits
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.runtime_context import get_parallel

from sglang_dsa_mtp.integration.state import ProcessorState, peek, state_of
from sglang_dsa_mtp.integration.tp_all_reduce import agree_across_group, all_reduce_route
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
    LOGITS_DTYPES,
    MAX_VOCAB,
    PartialsLayout,
    exchange_shape,
    launch_partials,
    partials_layout,
    warm_up,
)
from sglang_dsa_mtp.log import log_once
from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE

NO_PARTIALS = None  # LogitsProcessorOutput.next_token_argmax_partials everywhere else
DEFAULT_MAX_ROWS = 256

# Every live exchange buffer we handed out behind a stand-in, by the address of its storage. Weak:
# an entry goes with its buffer, which its stand-in keeps alive. (A view's ``_base`` would not do:
# inference mode, which SGLang's scheduler may run under, records no base for views.)
_EXCHANGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Exchange:
    """An engaged processor's exchange: its LM head, its shard's checked layout, the route."""

    lm_head: torch.nn.Module
    layout: PartialsLayout
    route: str


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


@dataclass
class ExchangeDecision:
    """What one opt-in decided, and the facts it decided on (for its one log line)."""

    reason: Optional[str] = None  # why the gather is kept; None when the exchange engaged
    facts: dict = field(default_factory=dict)

    @property
    def engaged(self) -> bool:
        return self.reason is None

    def line(self) -> str:
        facts = ", ".join(f"{name} {value}" for name, value in self.facts.items())
        if self.engaged:
            return f"draft_argmax_exchange on: greedy draft exchanges argmax partials ({facts})"
        return (
            f"draft_argmax_exchange off: greedy draft keeps the logits gather: {self.reason} "
            f"({facts})"
        )

    def log(self) -> None:
        """The decision at INFO, once per process for each distinct line."""
        line = self.line()
        log_once(logging.INFO, ("argmax-exchange-opt-in", line), "sglang_dsa_mtp: %s", line)


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


def shard_exchange_blocker(
    processor, lm_head, group, rows: list[int], facts: dict, *, draft_steps: Optional[int] = None
) -> Optional[str]:
    """The checks both argmax exchanges (draft and target verify) make once the switch, the
    processor and the LM head allow one: the logits dtypes, the shard's layout, the all-reduce
    route of the exchange buffer at 1 and the most ``rows`` (never NCCL inside a CUDA-graph
    capture), and every kernel variant for ``rows`` compiled ahead. Why this rank must keep
    SGLang's gather, or None; ``facts`` gets the route, the variant count and the ``layout``."""
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
    decision.reason = agreed_blocker(
        lm_head,
        decision.facts,
        lambda group, facts: _local_blocker(
            processor, lm_head, group, max_rows, capture_rows, draft_steps, facts
        ),
    )
    layout = decision.facts.pop("layout", None)
    state = state_of(processor, ProcessorState)
    if not decision.engaged:
        state.exchange = None
        return decision
    state.exchange = Exchange(lm_head, layout, decision.facts.get("all-reduce"))
    _prebuild_gatherer(processor, lm_head)
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


def _prebuild_gatherer(processor, lm_head) -> None:
    """Run the processor's logits gather once now, on every rank (all ranks engaged together).

    SGLang's ``MultimemAllGatherer`` builds its symmetric-memory buffer (max tokens x vocab) on its
    first eager call; without the exchange that is a draft-decode capture warm-up at start-up. With
    the exchange, draft decode no longer gathers, and the first gather would be the first draft
    prefill while serving: an unplanned collective allocation there. A failure here is logged and
    leaves the gather to build lazily, as before."""
    fp32 = processor.use_fp32_lm_head or processor.use_fp32_lm_head_output
    dtype = torch.float32 if fp32 else lm_head.weight.dtype
    try:
        processor._logits_gatherer(
            torch.zeros(
                (1, lm_head.num_embeddings_per_partition), dtype=dtype, device=lm_head.weight.device
            )
        )
    except Exception as exc:
        log_once(
            logging.WARNING,
            ("argmax-exchange-prebuild", type(exc).__name__),
            "sglang_dsa_mtp: building the draft logits gather ahead failed (%s: %s); it builds "
            "on its first call instead",
            type(exc).__name__,
            exc,
        )


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
