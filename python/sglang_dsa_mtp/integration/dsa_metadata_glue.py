"""Hook sites: every DSA graph runner's replay prep through SGLang's own ``MetadataGlueGraph``.

Before each CUDA-graph replay a DSA backend's out-of-graph prep (``init_forward_metadata_out_graph``:
the replay-metadata kernel, SGLang's or ours, then SGLang's refreshes that read it) runs on the host,
eagerly, in every runner of an EAGLE round. SGLang 0.5.23's ``MetadataGlueGraph`` runs a prep
eagerly twice per key, captures the third call, then replays it as one graph launch; SGLang routes
only its decode runner there, only without padding, behind a process-wide switch that glues every
backend, and captures each key while serving. With ``SGLANG_DSA_METADATA_GLUE`` on, for DSA
backends only, each runner's prep goes through a ``MetadataGlueGraph``, padded replays included:

* **capture**: AROUND ``DeepseekSparseAttnBackend.init_forward_metadata_out_graph``, right after a
  runner builds a bs's graph metadata (``in_capture``, outside stream capture), the backend's glue
  runs the prep for that bs and mode as a replay would (the runner's input buffers, sliced to bs)
  until it has captured it: the server's capture pays the warm-ups and the capture, not the first
  request. The MTP draft decode does the same from ``dsa_mtp_draft_metadata``'s hook;
* **target verify and plain decode** (``DecodeCudaGraphRunner``): AROUND
  ``_init_replay_attn_metadata``, the runner's first replay gives it its backend's glue (where
  SGLang's own switch gave it none); every replay then goes through it, keyed as SGLang keys it
  (``(bs, capture mode, mode)``, the captured bs: padded or not), a captured key replayed without
  building the replay view;
* **the EAGLE draft extend** (which SGLang never glues): each replay through the backend's glue;
* **the MTP draft decode** (likewise): each replay through the multi-step backend's glue, reading
  the runner's input buffers as captured (an unpadded replay hands the prep the batch's own tensors,
  whose values the runner has just copied into those buffers).

Why each prep is constant per key, padded replays included, line by line: docs/glue-audit.md. A
glue takes a :class:`GluedPrep` (the prep and the backends whose ``forward_metadata`` it
snapshots). A glue whose capture raises turns itself off for its runner (SGLang's class); any other
error at a hook site sends that runner to the eager prep for good, logged once at ERROR.
:func:`glue_counts` says what each glue served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.state import (
    UNDECIDED,
    BackendState,
    GlueCounts,
    GlueState,
    MultiStepState,
    RunnerState,
    peek,
    state_of,
)
from sglang_dsa_mtp.log import gate_failure, log_failure, log_once, logger
from sglang_dsa_mtp.switches import METADATA_GLUE

OFF = "the glue turned itself off (a capture raised)"


class GluedPrep:
    """A prep as ``MetadataGlueGraph.run`` takes a backend: ``prep(fb)`` runs it; at capture the
    glue snapshots the ``forward_metadata`` of ``attn_backend_list`` and puts it back at every
    replay (this object's own is None, kept as it is)."""

    def __init__(self, prep: Callable[[Any], None], leaves: list):
        self._prep = prep
        self.attn_backend_list = leaves
        self.forward_metadata = None

    def init_forward_metadata_out_graph(self, forward_batch) -> None:
        self._prep(forward_batch)


def glue_counts(owner, kind: type) -> GlueCounts | None:
    """What the glue of ``owner`` served (``kind``: its state's type, :class:`RunnerState` for a
    decode runner, :class:`BackendState` for the draft-extend backend, :class:`MultiStepState` for
    the multi-step backend); None before it was decided."""
    state = peek(owner, kind).glue
    return None if state.reason == UNDECIDED else state.counts


def _decide(state: GlueState, what: str, why_not: Callable[[], str | None], make) -> None:
    """Decide once whether ``state`` glues (``why_not()``; ``make()`` the glue), logged once."""
    try:
        reason = why_not()
        if reason is None:
            state.glue = make()
    except Exception as exc:  # never take the server down: the eager prep stays
        reason = gate_failure(exc, f"the {what} keeps its replay prep eager")
    state.reason = reason
    if reason is None:
        logger.info(
            "sglang_dsa_mtp: metadata_glue on for the %s: its replay prep through SGLang's "
            "MetadataGlueGraph, captured with the server's graphs, padded replays included",
            what,
        )
    else:
        logger.info("sglang_dsa_mtp: metadata_glue off for the %s: %s", what, reason)


def _failed(state: GlueState, what: str, exc: Exception) -> None:
    state.reason = f"raised {type(exc).__name__}: {exc}"
    log_failure(
        ("glue-failed", what),
        exc,
        "sglang_dsa_mtp: the %s's metadata glue is off from now on (eager prep)",
        what,
    )


def _new_glue(device):
    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

    return MetadataGlueGraph(device)


def _capture_key(glue, prep: GluedPrep, forward_batch, key) -> None:
    """Run ``forward_batch``'s prep through ``glue`` until ``key`` is captured (the glue's eager
    warm-ups, then its capture). Not inside a stream capture: then the key is captured at its first
    replays, while serving."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(
            logging.WARNING,
            ("glue-in-capture", key[1:]),
            "sglang_dsa_mtp: DSA graph metadata built inside a stream capture: its metadata glue "
            "captures at the first replays instead",
        )
        return
    while not glue.disabled and not glue.is_captured(key):
        glue.run(prep, forward_batch, key)


# ----------------------------------------------------------------------------------------------
# A DSA backend: capture for its runner; the draft extend's replays
# ----------------------------------------------------------------------------------------------


def _why_not_backend(backend, mode) -> str | None:
    reason = why_off(METADATA_GLUE)
    if reason is not None:
        return reason
    if mode.is_draft_extend_v2() and backend.dsa_index_kpool != 1:
        return (
            f"dsa_index_kpool is {backend.dsa_index_kpool}: the draft-extend prep then reads the "
            "round's own num_accept_tokens"
        )
    return None


def _role(backend, mode) -> str | None:
    """The runner a backend's prep in ``mode`` serves, or None where it is not glued here (an MTP
    draft step's, which the multi-step backend's glue covers; other modes)."""
    if mode.is_target_verify():
        return "target-verify backend"
    if mode.is_draft_extend_v2():
        return "draft-extend backend"
    if mode.is_decode_or_idle() and not getattr(backend, "speculative_num_steps", 0):
        return "decode backend"
    return None


def glue_key(bs: int, mode) -> tuple:
    """The key a DSA backend's glue captures ``mode``'s prep of ``bs`` under: the decode runner's
    (``DecodeCudaGraphRunner._glue_key``: captured bs, capture mode, replay mode)."""
    return (bs, str(mode), str(mode))


def dsa_prep(original, self, forward_batch, in_capture=False):
    """AROUND ``DeepseekSparseAttnBackend.init_forward_metadata_out_graph``."""
    mode = forward_batch.forward_mode
    if in_capture:
        result = original(self, forward_batch, in_capture=True)
        role = _role(self, mode)
        if role is not None:
            _capture_backend(original, self, forward_batch, role)
        return result
    if not mode.is_draft_extend_v2():
        return original(self, forward_batch)
    state = state_of(self, BackendState).glue
    if state.reason is None:
        key = glue_key(forward_batch.batch_size, mode)
        if _run(state, "draft-extend backend", forward_batch, key):
            return None
    return original(self, forward_batch)  # it rewrites every buffer a failed glue wrote


def _run(state: GlueState, what: str, forward_batch, key, *, padded: bool = False) -> bool:
    """A draft runner's replay prep through its glue (``state.glue``: its prep and its
    ``MetadataGlueGraph``), counted; False where it did not run there (the glue turned itself off,
    or ``what``'s glue raised: off from now on), and the caller runs the eager prep."""
    prep, glue = state.glue
    if glue.disabled:
        state.eager(OFF)
        return False
    state.counts.routed += 1
    state.counts.padded += padded
    try:
        glue.run(prep, forward_batch, key)
    except Exception as exc:
        _failed(state, what, exc)
        return False
    return True


def _capture_backend(original, backend, forward_batch, role: str) -> None:
    state = state_of(backend, BackendState).glue
    mode = forward_batch.forward_mode
    if state.reason == UNDECIDED:
        _decide(
            state,
            role,
            lambda: _why_not_backend(backend, mode),
            lambda: (
                GluedPrep(lambda fb: original(backend, fb), [backend]),
                _new_glue(backend.device),
            ),
        )
    if state.reason is not None:
        return
    prep, glue = state.glue
    try:
        _capture_key(glue, prep, forward_batch, glue_key(forward_batch.batch_size, mode))
    except Exception as exc:
        _failed(state, role, exc)


def captured_glue(owner, kind: type = BackendState):
    """The ``MetadataGlueGraph`` ``owner`` captured its runner's keys in, or None (``kind``: its
    state's type, :class:`BackendState` for a DSA backend, :class:`MultiStepState` for the
    multi-step backend)."""
    state = peek(owner, kind).glue
    return None if state.reason is not None else state.glue[1]


# ----------------------------------------------------------------------------------------------
# Target verify and plain decode: the decode runner's route
# ----------------------------------------------------------------------------------------------


def _why_not_runner(runner) -> str | None:
    reason = why_off(METADATA_GLUE)
    if reason is not None:
        return reason
    backend = runner.attn_backend
    if type(backend) is not sglang_surface.resolve(sglang_surface.DSA):
        return f"its attention backend is {type(backend).__name__}, not DSA's"
    if type(runner) is not sglang_surface.resolve(sglang_surface.DECODE_RUNNER):
        return f"{type(runner).__name__} routes its own replays"
    if runner.model_runner.spec_algorithm.is_dflash_family():
        return "DFlash-family speculative decoding (SGLang keeps its prep eager)"
    if runner.enable_pdmux:
        return "pdmux is on (a backend per stream)"
    if sglang_surface.early_verify_metadata(runner) is not None:
        return "SGLang stages this runner's verify metadata early"
    return None


def _give_runner_glue(runner) -> None:
    """The runner's glue, at its first replay: its backend's (the keys captured with the server's
    graphs; in place of SGLang's own, which has captured nothing yet), else SGLang's, else a new
    one (keys captured while serving)."""
    glue = captured_glue(runner.attn_backend)
    if glue is None and sglang_surface.metadata_glue(runner) is None:
        glue = _new_glue(runner.device)
    if glue is not None:
        sglang_surface.install_metadata_glue(runner, glue)


def glue_replay_prep(original, self, forward_batch, **kwargs):
    """AROUND ``DecodeCudaGraphRunner._init_replay_attn_metadata``."""
    state = state_of(self, RunnerState).glue
    if state.reason == UNDECIDED:
        role = _runner_role(self)
        _decide(state, role, lambda: _why_not_runner(self), lambda: _give_runner_glue(self))
    if state.reason is not None:
        return original(self, forward_batch, **kwargs)
    why = _why_eager(self, kwargs)
    if why is not None:
        state.eager(why)
        return original(self, forward_batch, **kwargs)
    state.counts.routed += 1
    state.counts.padded += kwargs["raw_bs"] != kwargs["bs"]
    try:
        sglang_surface.glued_replay_prep(self, forward_batch, **kwargs)
    except Exception as exc:  # the prep again, eagerly: it rewrites every buffer it writes
        _failed(state, _runner_role(self), exc)
        return original(self, forward_batch, **kwargs)
    return None


def _runner_role(runner) -> str:
    mode = str(runner.capture_forward_mode).rsplit(".", 1)[-1].lower().replace("_", " ")
    return f"{mode} runner"


def _why_eager(runner, kwargs) -> str | None:
    """Why this replay's prep runs eagerly; None when it goes through the glue."""
    glue = sglang_surface.metadata_glue(runner)
    if glue is None or glue.disabled:
        return OFF
    if kwargs["early_staged"]:
        return "staged early"
    if runner.enable_two_batch_overlap:
        return "two-batch overlap"
    if runner.model_runner.lora_manager is not None:
        return "LoRA"
    return None


# ----------------------------------------------------------------------------------------------
# The MTP draft decode (from dsa_mtp_draft_metadata's hook)
# ----------------------------------------------------------------------------------------------


def capture_mtp(multi, forward_batch, eager: Callable[[Any], None]) -> None:
    """At the MTP draft decode's capture of a bs: keep its input buffers (the runner's, sliced to
    bs), which every replay's prep of that bs reads through the glue, and capture its prep
    (``eager(fb)``) as a replay runs it."""
    state = state_of(multi, MultiStepState).glue
    bs = forward_batch.batch_size
    if state.reason == UNDECIDED:
        _decide(
            state,
            "MTP draft-decode backend",
            lambda: why_off(METADATA_GLUE),
            lambda: (
                GluedPrep(eager, list(multi.attn_backends)),
                _new_glue(multi.attn_backends[0].device),
            ),
        )
    if state.reason is not None:
        return
    state.inputs[bs] = (forward_batch.seq_lens, forward_batch.req_pool_indices)
    prep, glue = state.glue
    try:
        view = SimpleNamespace(**vars(forward_batch), num_padding=0)  # as a replay hands it
        _capture_key(glue, prep, view, (bs,))
    except Exception as exc:
        _failed(state, "MTP draft-decode backend", exc)


def mtp_replay(multi, forward_batch) -> bool:
    """The MTP draft decode's replay prep through its glue; False when it did not run there (the
    caller runs the eager prep)."""
    state = peek(multi, MultiStepState).glue
    if state.reason is not None:
        return False
    view = _captured_inputs(state, forward_batch)
    if view is None:
        state.eager("inputs not the captured buffers")
        return False
    padded = bool(getattr(forward_batch, "num_padding", 0))
    key = (forward_batch.batch_size,)
    return _run(state, "MTP draft-decode backend", view, key, padded=padded)


def _captured_inputs(state: GlueState, forward_batch):
    """``forward_batch`` reading the input buffers its bs was captured with, or None where they
    cannot stand for its inputs (another shape, dtype or device; a padded replay on others)."""
    captured = state.inputs.get(forward_batch.batch_size)
    if captured is None:
        return None
    padded = getattr(forward_batch, "num_padding", 0)
    for have, want in zip((forward_batch.seq_lens, forward_batch.req_pool_indices), captured):
        if have.shape != want.shape or have.dtype != want.dtype or have.device != want.device:
            return None
        if padded and have.data_ptr() != want.data_ptr():
            return None
    view = SimpleNamespace(**vars(forward_batch))
    view.seq_lens, view.req_pool_indices = captured
    return view
