"""Hook site: SGLang 0.5.23's EAGLE v2 worker and its verify, reading the target verify's argmax from
exchanged partials (the processor's side: ``verify_argmax_exchange``; details: docs/switches.md,
"Greedy target-verify argmax exchange"):

- AFTER ``EAGLEWorkerV2.init_attention_backends`` (every rank, once the memory pools and attention
  backends exist, before SGLang captures any graph, the target's first): opts the target model's
  ``LogitsProcessor`` in for the captured target-verify rows, logging one INFO line;
- AROUND ``eagle_sample`` (the EAGLE verify): on a kept shard, a greedy batch that nothing else
  reads the logits of (:func:`full_logits_reader`) is verified against the exchanged argmax, the
  logits a meta stand-in while SGLang's verify runs and ``next_token_logits`` None after; any other
  batch first gets the full logits (``vocab_shard_exchange.full_logits``), then SGLang's path;
- AROUND ``verify_tree_greedy_func``: during such a greedy verify, the tree verify gets the
  exchanged argmax as ``target_predict`` in place of ``torch.argmax`` of the stand-in (a meta
  tensor).

Predict, accept index, accept lengths and the committed tokens are SGLang's, bit for bit.
"""

from __future__ import annotations

import contextvars
from typing import Optional

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_executor.runner import get_batch_sizes_to_capture
from sglang.srt.runtime_context import get_flags, get_parallel, get_spec
from sglang.srt.speculative import spec_utils
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.tp_all_reduce import agree_across_group
from sglang_dsa_mtp.integration.verify_argmax_exchange import (
    DEFAULT_MAX_ROWS,
    VerifyDecision,
    opt_in,
    verify_state,
)
from sglang_dsa_mtp.integration.vocab_shard_exchange import full_logits, kept_shard_of
from sglang_dsa_mtp.switches import VERIFY_ARGMAX_EXCHANGE

# Target models whose forward returns the LogitsProcessor's output untouched (checked in 0.5.23:
# DeepseekV2ForCausalLM.forward, which the others inherit).
TARGET_MODELS = (
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM",
    "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
    "sglang.srt.models.deepseek_v2.DeepseekV32ForCausalLM",
    "sglang.srt.models.glm4_moe.GlmMoeDsaForCausalLM",
)
# SGLang switches whose probes read the verify logits, or rewrite them, before the argmax.
LOGIT_PROBES = (
    "SGLANG_ENABLE_ASYNC_ASSERT",
    "SGLANG_ENABLE_NAN_LOGITS_CHECK",
    "SGLANG_SANITIZE_NAN_LOGITS",
)

# Set while SGLang's verify of a greedy batch runs: that batch's exchanged argmax, int64 [rows, 1].
_PENDING_PREDICT: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar(
    "sglang_dsa_mtp_verify_predict", default=None
)


def _target_model(worker):
    return getattr(
        getattr(getattr(worker, "target_worker", None), "model_runner", None), "model", None
    )


def why_not_verify_exchange(worker) -> Optional[str]:
    """Why this EAGLE worker's target verify must keep SGLang's full logits, or None."""
    reason = why_off(VERIFY_ARGMAX_EXCHANGE)
    if reason is not None:
        return reason
    if type(worker) is not EAGLEWorkerV2:
        return (
            f"the speculative worker is {type(worker).__name__}, not SGLang's EAGLEWorkerV2 "
            "(whose verify path was checked)"
        )
    if get_parallel().pp_size > 1:
        return "pipeline parallelism (--pp-size > 1) relays the verify between stages"
    if get_spec().speculative_adaptive:
        return (
            "adaptive speculation (--speculative-adaptive) captures target-verify graphs of other "
            "draft-token counts"
        )
    if get_flags().capture.enable_torch_compile:
        return "torch.compile (--enable-torch-compile) traces the target forward and its hooks"
    for name in LOGIT_PROBES:
        if getattr(envs, name).get():
            return f"{name} is on: it reads the verify logits before the argmax"
    if spec_utils.SIMULATE_ACC_LEN > 0:
        return "SGLANG_SIMULATE_ACC_LEN is set: the simulated acceptance reads the verify's argmax"
    model = _target_model(worker)
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    if name not in TARGET_MODELS:
        return (
            f"the target model {type(model).__name__} is not one whose forward hands the "
            "processor's output on untouched (DeepSeek-V2/V3/V3.2 and GLM-5 DSA models)"
        )
    if not isinstance(getattr(model, "logits_processor", None), LogitsProcessor):
        return f"the target model {type(model).__name__} has no LogitsProcessor `logits_processor`"
    if getattr(model, "lm_head", None) is None:
        return f"the target model {type(model).__name__} has no `lm_head`"
    return None


def _verify_rows(worker) -> list[int]:
    """The row counts of the target-verify graphs SGLang captures: each captured batch size
    (``get_batch_sizes_to_capture`` at the verify's tokens per request) x draft tokens."""
    tokens = worker.speculative_num_draft_tokens
    try:
        capture_bs, _ = get_batch_sizes_to_capture(worker.target_worker.model_runner, tokens)
        return sorted({int(bs) * tokens for bs in capture_bs})
    except Exception:
        return [DEFAULT_MAX_ROWS]


def _worker_facts(worker) -> dict:
    facts = {"target model": type(_target_model(worker)).__name__}
    try:
        facts["tp size"] = get_parallel().tp_group.world_size
    except Exception:
        pass
    return facts


def opt_in_target_model(result, worker, *args, **kwargs):
    """AFTER ``EAGLEWorkerV2.init_attention_backends``: opt the target model's processor in.

    Every rank of the TP group runs this, before SGLang captures the target-verify graphs; the
    ranks first agree on the worker's conditions, then the processor's opt-in agrees on its own
    and compiles the kernels. One INFO line says what was decided and on which facts. A processor
    already engaged stays engaged."""
    model = _target_model(worker)
    processor = getattr(model, "logits_processor", None)
    if isinstance(processor, LogitsProcessor) and verify_state(processor) is not None:
        return None
    facts = _worker_facts(worker)
    try:
        reason = why_not_verify_exchange(worker)
    except Exception as exc:  # never take the server down: SGLang's path stays
        reason = f"the opt-in raised {type(exc).__name__}: {exc}"
    try:
        reason = agree_across_group(get_parallel().tp_group, reason)
        if reason is None:
            rows = _verify_rows(worker)
            decision = opt_in(
                processor, model.lm_head, max_rows=max(rows), capture_rows=rows, facts=facts
            )
        else:
            decision = VerifyDecision(reason, facts)
    except Exception as exc:
        decision = VerifyDecision(f"the opt-in raised {type(exc).__name__}: {exc}", facts)
    decision.log()
    return None


def full_logits_reader(batch, grammar_mask, watermark_state) -> Optional[str]:
    """What reads this verify batch's logits beyond the greedy argmax, or None: SGLang 0.5.23's
    EAGLE verify and what runs after it (docs/switches.md lists each reader)."""
    info = batch.sampling_info
    if not info.is_all_greedy:
        return "a request samples"
    if batch.return_logprob:
        return "logprobs (return_logprob)"
    if grammar_mask is not None:
        return "a grammar vocab mask"
    penalizer = info.penalizer_orchestrator
    if (
        info.acc_additive_penalties is not None
        or info.acc_scaling_penalties is not None
        or (penalizer is not None and penalizer.is_required)
    ):
        return "penalties"
    if info.logit_bias is not None:
        return "a logit bias"
    if info.has_custom_logit_processor:
        return "a custom logit processor"
    if watermark_state is not None and info.has_watermark_candidates:
        return "watermarking"
    return None


def verify_sample(original, verify_input, batch, logits_output, *args, **kwargs):
    """AROUND ``eagle_sample``: on a kept target-verify shard, a greedy batch nothing else reads
    verifies against the exchanged argmax; any other batch gets SGLang's full logits first."""
    kept = kept_shard_of(getattr(logits_output, "next_token_logits", None))
    if kept is None:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    record, start = kept
    shard = logits_output.next_token_logits
    grammar_mask = args[0] if args else kwargs.get("grammar_mask")
    if full_logits_reader(batch, grammar_mask, kwargs.get("watermark_state")) is not None:
        logits_output.next_token_logits = full_logits(record, start, shard)
        return original(verify_input, batch, logits_output, *args, **kwargs)
    rows = shard.shape[0]
    logits_output.next_token_logits = torch.empty(
        (rows, record.processor.vocab_size), dtype=torch.float32, device="meta"
    )
    token = _PENDING_PREDICT.set(record.tokens[start : start + rows])
    try:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        _PENDING_PREDICT.reset(token)
        logits_output.next_token_logits = None


def _exchanged(target_predict, predict):
    if isinstance(target_predict, torch.Tensor) and target_predict.is_meta:
        return predict.view(target_predict.shape)
    return target_predict


def greedy_verify_pick(original, *args, **kwargs):
    """AROUND ``verify_tree_greedy_func``: during the greedy verify of a kept shard, the exchanged
    argmax stands in for ``torch.argmax`` of the meta stand-in logits."""
    predict = _PENDING_PREDICT.get()
    if predict is not None:
        if "target_predict" in kwargs:
            kwargs["target_predict"] = _exchanged(kwargs["target_predict"], predict)
        elif len(args) > 7:
            args = (*args[:7], _exchanged(args[7], predict), *args[8:])
    return original(*args, **kwargs)
