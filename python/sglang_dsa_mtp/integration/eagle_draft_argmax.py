"""Hook site: SGLang 0.5.23's EAGLE v2 draft worker, picking greedy draft tokens from argmax partials.

Tokens, ``topk_p`` and positions are SGLang's, bit for bit (the processor's side:
``draft_argmax_exchange``; details: docs/switches.md, "Who opts in", "Where the token is picked"):

- BEFORE ``EagleDraftWorker._capture_cuda_graphs``: opts a greedy draft of ``DRAFT_MODELS`` in
  (``draft_argmax_exchange.opt_in``, kernels compiled ahead), logging one INFO line;
- AROUND ``draft_topk1_postprocess`` (draft decode, in its graph): on an exchange, the ``sanitize``
  finalize;
- AROUND ``EAGLEDraftExtendCudaGraphRunner.execute``: puts the partials back and, when asked, picks
  the token right after the replay with the ``propagate`` rule (``torch.argmax``'s);
- AROUND ``EagleDraftWorker._draft_extend_for_decode``: asks for that pick and stores it in the next
  draft input. The eager draft extend keeps SGLang's gather and pick.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_executor.runner import get_batch_sizes_to_capture
from sglang.srt.runtime_context import get_flags, get_parallel, get_spec

from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.draft_argmax_exchange import (
    DEFAULT_MAX_ROWS,
    ExchangeDecision,
    exchange_of,
    exchange_state,
    opt_in,
)
from sglang_dsa_mtp.integration.tp_all_reduce import agree_across_group
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import launch_finalize
from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE

# Draft models whose forward returns the LogitsProcessor's output untouched (checked in 0.5.23).
DRAFT_MODELS = (
    "sglang.srt.models.deepseek_nextn.DeepseekV3ForCausalLMNextN",
    "sglang.srt.models.glm4_moe.GlmMoeDsaForCausalLMNextN",
    "sglang.srt.models.glm5_next_nextn.Glm5NextForConditionalGenerationNextN",
)


@dataclass
class _Pick:
    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None


# Set while _draft_extend_for_decode runs: where the replay leaves its pick, if it has partials.
_PENDING_PICK: contextvars.ContextVar[Optional[_Pick]] = contextvars.ContextVar(
    "sglang_dsa_mtp_draft_extend_pick", default=None
)


def why_not_exchange(worker) -> Optional[str]:
    """Why this draft worker's greedy picks must keep reading gathered logits, or None."""
    reason = why_off(DRAFT_ARGMAX_EXCHANGE)
    if reason is not None:
        return reason
    if worker.topk != 1:
        return f"--speculative-eagle-topk is {worker.topk}: drafts need probabilities"
    if worker.hot_token_id is not None:
        return "a hot-token map (--speculative-token-map) reindexes the draft vocab"
    if get_spec().speculative_use_rejection_sampling:
        return "rejection sampling (--speculative-use-rejection-sampling) samples the draft logits"
    if get_flags().capture.enable_torch_compile:
        return "torch.compile (--enable-torch-compile) traces the draft forward and its hooks"
    for name in ("SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_ENABLE_NAN_LOGITS_CHECK"):
        if getattr(envs, name).get():
            return f"{name} is on: its probes read the draft logits"
    model = worker.draft_runner.model
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    if name not in DRAFT_MODELS:
        return (
            f"the draft model {type(model).__name__} is not one whose forward hands the "
            "processor's output on untouched (DeepSeek-V3/V3.2 and GLM-5 NextN MTP heads)"
        )
    if not isinstance(getattr(model, "logits_processor", None), LogitsProcessor):
        return f"the draft model {type(model).__name__} has no LogitsProcessor `logits_processor`"
    if getattr(model, "lm_head", None) is None:
        return f"the draft model {type(model).__name__} has no `lm_head`"
    return None


def _captured_rows(worker) -> list[int]:
    """The batch sizes SGLang captures the draft graphs at (one LM-head row per request at topk
    1, in draft decode and in the graph draft extend alike)."""
    try:
        capture_bs, _ = get_batch_sizes_to_capture(worker.draft_runner)
        return sorted({int(bs) for bs in capture_bs})
    except Exception:
        return [DEFAULT_MAX_ROWS]


def _worker_facts(worker) -> dict:
    """The draft worker's facts for the opt-in's log line, as far as they can be read."""
    model = getattr(getattr(worker, "draft_runner", None), "model", None)
    facts = {"draft model": type(model).__name__, "topk": getattr(worker, "topk", "unknown")}
    try:
        facts["tp size"] = get_parallel().tp_group.world_size
    except Exception:
        pass
    return facts


def opt_in_draft_model(worker, *args, **kwargs):
    """BEFORE ``EagleDraftWorker._capture_cuda_graphs``: opt the draft model's processor in.

    Every rank of the draft's TP group runs this before capturing; the ranks first agree on the
    worker's conditions, then the processor's opt-in agrees on its own and compiles the kernels
    for the captured batch sizes. One INFO line says what was decided and on which facts. SGLang
    captures again for each adaptive-speculation state: a processor that is already engaged stays
    engaged (graphs captured with the exchange are still replayed)."""
    model = getattr(getattr(worker, "draft_runner", None), "model", None)
    processor = getattr(model, "logits_processor", None)
    if isinstance(processor, LogitsProcessor) and exchange_state(processor) is not None:
        return None
    facts = _worker_facts(worker)
    try:
        reason = why_not_exchange(worker)
    except Exception as exc:  # never take the server down: the gather stays
        reason = f"the opt-in raised {type(exc).__name__}: {exc}"
    try:
        reason = agree_across_group(get_parallel().tp_group, reason)
        if reason is None:
            rows = _captured_rows(worker)
            decision = opt_in(
                model.logits_processor,
                model.lm_head,
                max_rows=max(rows),
                capture_rows=rows,
                draft_steps=worker.speculative_num_steps,
                facts=facts,
            )
        else:
            decision = ExchangeDecision(reason, facts)
    except Exception as exc:
        decision = ExchangeDecision(f"the opt-in raised {type(exc).__name__}: {exc}", facts)
    decision.log()
    return None


def draft_decode_pick(original, next_token_logits, positions, *args, **kwargs):
    """AROUND ``draft_topk1_postprocess``: on an exchange stand-in, finalize from the partials."""
    exchange = exchange_of(next_token_logits)
    if exchange is None:
        return original(next_token_logits, positions, *args, **kwargs)
    return launch_finalize(exchange, positions, *args, **kwargs, propagate_nan=False)


def draft_extend_replay_pick(original, runner, *args, **kwargs):
    """AROUND ``EAGLEDraftExtendCudaGraphRunner.execute``: keep the partials in the rebuilt output,
    and pick the tokens from them when the draft worker asked for it."""
    out = original(runner, *args, **kwargs)
    exchange = exchange_of(out.next_token_logits)
    if exchange is None:
        return out
    out.next_token_argmax_partials = exchange
    pick = _PENDING_PICK.get()
    if pick is not None:
        pick.topk_p, pick.topk_index = launch_finalize(exchange, propagate_nan=True)
        out.next_token_logits = torch.empty(
            out.next_token_logits.shape, dtype=torch.float32, device="meta"
        )
    return out


def draft_extend_for_decode(original, worker, batch, batch_result, *args, **kwargs):
    """AROUND ``EagleDraftWorker._draft_extend_for_decode``: the next draft input gets the tokens
    picked from the partials when the draft-extend replay produced them."""
    pick = _Pick()
    token = _PENDING_PICK.set(pick)
    try:
        result = original(worker, batch, batch_result, *args, **kwargs)
    finally:
        _PENDING_PICK.reset(token)
    if pick.topk_index is not None:
        next_draft_input = batch_result.next_draft_input
        next_draft_input.topk_p, next_draft_input.topk_index = pick.topk_p, pick.topk_index
    return result
