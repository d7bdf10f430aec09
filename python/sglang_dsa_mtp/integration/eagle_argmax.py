"""Hook sites on SGLang 0.5.23's EAGLE v2 workers for the vocab-shard argmax exchange: the opt-ins
and the picks, each a thin call into the role's ``VocabShardExchange`` (``vocab_shard_exchange``,
which owns the exchange, the processor's hooks and the hand-off ``HANDOFF``). Tokens, ``topk_p``,
positions, predict, accept index, accept lengths and the committed tokens are SGLang's, bit for bit.

The opt-ins (every rank of the TP group runs one; the ranks agree first on the worker's conditions,
:func:`why_not_exchange`, then the processor's opt-in agrees on its own and compiles the kernels for
the captured row counts; one INFO line says what was decided and on which facts; a processor already
engaged stays engaged, since graphs captured with the exchange are still replayed):

- BEFORE ``EagleDraftWorker._capture_cuda_graphs`` (:func:`opt_in_draft_model`): a greedy draft of
  ``sglang_surface.DRAFT_MODELS``, for its captured batch sizes;
- AFTER ``EAGLEWorkerV2.init_attention_backends`` (:func:`opt_in_target_model`; the memory pools and
  attention backends exist, no graph is captured yet, the target's first): the target model of
  ``sglang_surface.TARGET_MODELS``, for its target-verify rows (batch sizes x draft tokens).

The draft's picks (the eager draft extend keeps SGLang's gather and pick):

- AROUND ``draft_topk1_postprocess`` (draft decode, in its graph; :func:`draft_decode_pick`): on the
  draft exchange's stand-in, the ``sanitize`` finalize;
- AROUND ``EAGLEDraftExtendCudaGraphRunner.execute`` (:func:`draft_extend_replay_pick`): puts the
  partials back in the rebuilt output and, when asked, picks right after the replay with the
  ``propagate`` rule (``torch.argmax``'s), SGLang's argmax then running on a meta tensor;
- AROUND ``EagleDraftWorker._draft_extend_for_decode`` (:func:`draft_extend_for_decode`): asks for
  that pick and stores it in the next draft input.

The verify's pick:

- AROUND ``eagle_sample`` (:func:`verify_sample`): on the verify exchange's kept shard, a greedy
  batch that nothing else reads the logits of (:func:`full_logits_reader`) is verified against the
  exchanged argmax, the logits a meta stand-in while SGLang's verify runs and None after; any other
  batch first gets SGLang's full logits, then SGLang's path;
- AROUND ``verify_tree_greedy_func`` (:func:`greedy_verify_pick`): during such a greedy verify, the
  exchanged argmax as ``target_predict`` (bound by name) in place of the argmax of the stand-in.

An opt-in keeps SGLang's path on any exception, which its INFO line names and which is logged once
at ERROR. The picks have no fallback (``vocab_shard_exchange`` says why): once a processor engaged,
its graphs hold no logits for SGLang's path to read. Details: docs/switches.md, "Who opts in",
"Where the token is picked" and the target-verify section.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.kernels.ops.speculative import spec_tree
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_executor.runner import get_batch_sizes_to_capture
from sglang.srt.runtime_context import get_flags, get_parallel, get_spec
from sglang.srt.speculative import eagle_utils, spec_utils
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.state import ProcessorState, peek
from sglang_dsa_mtp.integration.vocab_shard_exchange import (
    DEFAULT_MAX_ROWS,
    DRAFT,
    HANDOFF,
    VERIFY,
    Decision,
    Role,
    agree_across_group,
    opt_in,
    raised,
)
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import launch_finalize

# SGLang switches whose probes read the draft logits; the verify logits, or rewrite them, before the
# argmax.
DRAFT_PROBES = ("SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_ENABLE_NAN_LOGITS_CHECK")
LOGIT_PROBES = (*DRAFT_PROBES, "SGLANG_SANITIZE_NAN_LOGITS")


@dataclass(frozen=True)
class _Side:
    """The EAGLE worker's side of one role, as the gate words it: the ``model`` whose processor
    takes the role, the ``models`` that may, what they are (``kinds``), and the ``probes`` that keep
    SGLang's path, which ``read`` its logits."""

    model: str
    models: tuple[str, ...]
    kinds: str
    probes: tuple[str, ...]
    read: str


_SIDES = {
    DRAFT: _Side(
        "draft",
        sglang_surface.DRAFT_MODELS,
        "DeepSeek-V3/V3.2 and GLM-5 NextN MTP heads",
        DRAFT_PROBES,
        "its probes read the draft logits",
    ),
    VERIFY: _Side(
        "target",
        sglang_surface.TARGET_MODELS,
        "DeepSeek-V2/V3/V3.2 and GLM-5 DSA models",
        LOGIT_PROBES,
        "it reads the verify logits before the argmax",
    ),
}

# The signatures the picks bind SGLang's arguments to, by name.
_SAMPLE = inspect.signature(eagle_utils.eagle_sample)
_GREEDY_VERIFY = inspect.signature(spec_tree.verify_tree_greedy_func)


# --- the opt-ins ----------------------------------------------------------------------------------


def _model(worker, role: Role):
    """The model whose ``LogitsProcessor`` takes ``role``: the draft model, or the target model."""
    if role is DRAFT:
        return getattr(getattr(worker, "draft_runner", None), "model", None)
    runner = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    return getattr(runner, "model", None)


def _draft_blocker(worker) -> Optional[str]:
    if worker.topk != 1:
        return f"--speculative-eagle-topk is {worker.topk}: drafts need probabilities"
    if worker.hot_token_id is not None:
        return "a hot-token map (--speculative-token-map) reindexes the draft vocab"
    if get_spec().speculative_use_rejection_sampling:
        return "rejection sampling (--speculative-use-rejection-sampling) samples the draft logits"
    return None


def _verify_blocker(worker) -> Optional[str]:
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
    if spec_utils.SIMULATE_ACC_LEN > 0:
        return "SGLANG_SIMULATE_ACC_LEN is set: the simulated acceptance reads the verify's argmax"
    return None


def why_not_exchange(worker, role: Role) -> Optional[str]:
    """Why ``worker`` must keep SGLang's path for ``role`` (DRAFT: its greedy draft picks; VERIFY:
    its target verify), or None: the switch and the role's own conditions, then those both share
    (no torch.compile, no probe reading the logits, a model whose forward hands the processor's
    output on untouched, with a ``LogitsProcessor`` and an ``lm_head``)."""
    side = _SIDES[role]
    reason = why_off(role.switch)
    reason = reason or (_draft_blocker(worker) if role is DRAFT else _verify_blocker(worker))
    if reason is not None:
        return reason
    if get_flags().capture.enable_torch_compile:
        return (
            f"torch.compile (--enable-torch-compile) traces the {side.model} forward and its hooks"
        )
    for name in side.probes:
        if getattr(envs, name).get():
            return f"{name} is on: {side.read}"
    model = _model(worker, role)
    name = type(model).__name__
    if f"{type(model).__module__}.{type(model).__qualname__}" not in side.models:
        return (
            f"the {side.model} model {name} is not one whose forward hands the processor's output "
            f"on untouched ({side.kinds})"
        )
    if not isinstance(getattr(model, "logits_processor", None), LogitsProcessor):
        return f"the {side.model} model {name} has no LogitsProcessor `logits_processor`"
    if getattr(model, "lm_head", None) is None:
        return f"the {side.model} model {name} has no `lm_head`"
    return None


def _captured_rows(worker, role: Role) -> list[int]:
    """The row counts of the graphs SGLang captures for ``role``: the draft's batch sizes (one
    LM-head row per request at topk 1, in draft decode and the graph draft extend alike); the
    target verify's batch sizes (``get_batch_sizes_to_capture`` at its tokens per request) times
    the draft tokens."""
    try:
        if role is DRAFT:
            capture_bs, _ = get_batch_sizes_to_capture(worker.draft_runner)
            return sorted({int(bs) for bs in capture_bs})
        tokens = worker.speculative_num_draft_tokens
        capture_bs, _ = get_batch_sizes_to_capture(worker.target_worker.model_runner, tokens)
        return sorted({int(bs) * tokens for bs in capture_bs})
    except Exception:
        return [DEFAULT_MAX_ROWS]


def _opt_in(worker, role: Role) -> None:
    """The opt-in of ``role`` for ``worker``'s model (the module docstring says how it goes)."""
    model = _model(worker, role)
    processor = getattr(model, "logits_processor", None)
    if isinstance(processor, LogitsProcessor):
        if getattr(peek(processor, ProcessorState), role.name) is not None:
            return
    facts = {f"{_SIDES[role].model} model": type(model).__name__}
    if role is DRAFT:
        facts["topk"] = getattr(worker, "topk", "unknown")
    try:
        facts["tp size"] = get_parallel().tp_group.world_size
    except Exception:
        pass
    try:
        reason = why_not_exchange(worker, role)
    except Exception as exc:  # never take the server down: SGLang's path stays
        reason = raised(role, "the opt-in", exc)
    try:
        reason = agree_across_group(get_parallel().tp_group, reason)
        if reason is None:
            rows = _captured_rows(worker, role)
            decision = opt_in(
                processor,
                model.lm_head,
                role,
                max_rows=max(rows),
                capture_rows=rows,
                draft_steps=worker.speculative_num_steps if role is DRAFT else None,
                facts=facts,
            )
        else:
            decision = Decision(role, reason, facts)
    except Exception as exc:
        decision = Decision(role, raised(role, "the opt-in", exc), facts)
    decision.log()


def opt_in_draft_model(worker, *args, **kwargs):
    """BEFORE ``EagleDraftWorker._capture_cuda_graphs``: opt the draft model's processor in."""
    _opt_in(worker, DRAFT)


def opt_in_target_model(result, worker, *args, **kwargs):
    """AFTER ``EAGLEWorkerV2.init_attention_backends``: opt the target model's processor in."""
    _opt_in(worker, VERIFY)


# --- the draft's picks ----------------------------------------------------------------------------


def _exchange_rows(logits) -> Optional[torch.Tensor]:
    """The draft exchange's rows behind ``logits`` when they are its stand-in, else None."""
    draft = HANDOFF.draft
    return None if draft is None else draft.exchange_rows(logits)


def draft_decode_pick(original, next_token_logits, positions, *args, **kwargs):
    """AROUND ``draft_topk1_postprocess``: on a stand-in, finalize from the partials."""
    exchange = _exchange_rows(next_token_logits)
    if exchange is None:
        return original(next_token_logits, positions, *args, **kwargs)
    return launch_finalize(exchange, positions, *args, **kwargs, propagate_nan=False)


def draft_extend_replay_pick(original, runner, *args, **kwargs):
    """AROUND ``EAGLEDraftExtendCudaGraphRunner.execute``: keep the partials in the rebuilt output,
    and pick the tokens from them when the draft worker asked for it."""
    out = original(runner, *args, **kwargs)
    exchange = _exchange_rows(out.next_token_logits)
    if exchange is None:
        return out
    out.next_token_argmax_partials = exchange
    if HANDOFF.extend_pick_asked:
        HANDOFF.extend_pick = launch_finalize(exchange, propagate_nan=True)
        out.next_token_logits = torch.empty(
            out.next_token_logits.shape, dtype=torch.float32, device="meta"
        )
    return out


def draft_extend_for_decode(original, worker, batch, batch_result, *args, **kwargs):
    """AROUND ``EagleDraftWorker._draft_extend_for_decode``: the next draft input gets the tokens
    picked from the partials when the draft-extend replay produced them."""
    HANDOFF.extend_pick_asked = True
    try:
        result = original(worker, batch, batch_result, *args, **kwargs)
        pick = HANDOFF.extend_pick
    finally:
        HANDOFF.extend_pick_asked, HANDOFF.extend_pick = False, None
    if pick is not None:
        next_draft_input = batch_result.next_draft_input
        next_draft_input.topk_p, next_draft_input.topk_index = pick
    return result


# --- the verify's pick ----------------------------------------------------------------------------


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
    verify, shard = HANDOFF.verify, getattr(logits_output, "next_token_logits", None)
    kept = None if verify is None else verify.kept_rows(shard)
    if kept is None:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    call = _SAMPLE.bind(verify_input, batch, logits_output, *args, **kwargs).arguments
    if full_logits_reader(batch, call.get("grammar_mask"), call.get("watermark_state")) is not None:
        logits_output.next_token_logits = verify.full_logits(shard, kept.start)
        return original(verify_input, batch, logits_output, *args, **kwargs)
    logits_output.next_token_logits = torch.empty(
        (shard.shape[0], verify.processor.vocab_size), dtype=torch.float32, device="meta"
    )
    HANDOFF.verify_predict = kept.tokens
    try:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        HANDOFF.verify_predict = None
        logits_output.next_token_logits = None


def greedy_verify_pick(original, *args, **kwargs):
    """AROUND ``verify_tree_greedy_func``: during the greedy verify of a kept shard, the exchanged
    argmax stands in for ``torch.argmax`` of the meta stand-in logits."""
    predict = HANDOFF.verify_predict
    if predict is None:
        return original(*args, **kwargs)
    call = _GREEDY_VERIFY.bind(*args, **kwargs)
    target_predict = call.arguments["target_predict"]
    if isinstance(target_predict, torch.Tensor) and target_predict.is_meta:
        call.arguments["target_predict"] = predict.view(target_predict.shape)
    return original(*call.args, **call.kwargs)
