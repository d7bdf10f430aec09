"""Hook sites: every DSA graph runner's replay prep through SGLang's own ``MetadataGlueGraph``.

Before each CUDA-graph replay a DSA backend's out-of-graph prep (``init_forward_metadata_out_graph``:
the replay-metadata kernel, SGLang's or ours, then SGLang's refreshes that read it) runs on the host,
eagerly, in every runner of an EAGLE round. SGLang 0.5.23's ``MetadataGlueGraph`` runs a prep
eagerly twice per key, captures the third call, then replays it as one graph launch; SGLang routes
only its decode runner there, only without padding, behind a process-wide switch that glues every
backend, and captures each key while serving, each in a memory pool of its own. With
``SGLANG_DSA_METADATA_GLUE`` on, for DSA backends only, each runner's prep goes through a
``MetadataGlueGraph``, padded replays included:

* **capture**: AROUND ``DeepseekSparseAttnBackend.init_forward_metadata_out_graph``, right after a
  runner builds a bs's graph metadata (``in_capture``, outside stream capture), the backend's glue
  runs the prep for that bs and mode as a replay would (the runner's input buffers, sliced to bs)
  until it has captured it: the server's capture pays the warm-ups and the capture, not a request.
  The MTP draft decode does the same from ``dsa_mtp_draft_metadata``'s hook. What a prep allocates
  inside its capture goes to one memory pool that every glue graph of the process shares
  (:func:`glue_pool`), not to a pool per key;
* **target verify and plain decode** (``DecodeCudaGraphRunner``): SGLang's own glue route, pointed
  at the backend's glue at the runner's first replay: an unpadded replay of a captured key
  (SGLang's ``glue_key``: captured bs, capture mode, mode) is that graph's replay in SGLang's
  replay prep (``MetadataGlueGraph.replay``, no replay view), with no code of the plugin's; every
  other replay comes to the hook AROUND ``_init_replay_attn_metadata_from_view``, where a padded
  replay of a captured key is that graph's replay too and the rest is SGLang's eager prep;
* **the EAGLE draft extend** (which SGLang never glues): each replay through the backend's glue;
* **the MTP draft decode** (likewise): each replay through the multi-step backend's glue, reading
  the runner's input buffers as captured (an unpadded replay hands the prep the batch's own tensors,
  whose values the runner has just copied into those buffers).

A key not captured with the server's graphs stays eager (counted, with the reason): no glue captures
while serving. Why each prep is constant per key, padded replays included, line by line:
docs/glue-audit.md. A glue takes a :class:`GluedPrep` (the prep and the backends whose
``forward_metadata`` it snapshots). A glue whose capture raises turns itself off for its runner
(SGLang's class); any other error at a hook site sends that runner to the eager prep for good,
logged once at ERROR (a decode runner's route then goes back to the glue it had).
:func:`glue_counts` says what each glue served.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
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
NOT_CAPTURED = "its key was not captured with the server's graphs"

_POOLS: dict[int, Any] = {}  # CUDA device index -> the torch.cuda.MemPool its glue graphs share


def glue_pool(device) -> Any:
    """The memory pool every glue graph on ``device`` allocates in while it captures (created at
    the first call; None off CUDA). One pool for all keys of all runners: a glue graph's
    temporaries are free again when its capture ends, so the next capture reuses them, and what a
    prep keeps (its metadata, snapshotted by the glue) stays allocated, so no other capture takes
    it. The graphs replay one at a time on the runner's stream, each before the forward that reads
    it; nothing outside a glue capture allocates in the pool."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    pool = _POOLS.get(index)
    if pool is None:
        pool = _POOLS[index] = torch.cuda.MemPool()
    return pool


class GluedPrep:
    """A prep as ``MetadataGlueGraph.run`` takes a backend: ``prep(fb)`` runs it, in ``pool`` while
    a stream captures (:func:`glue_pool`); at capture the glue snapshots the ``forward_metadata``
    of ``attn_backend_list`` and puts it back at every replay (this object's own is None, kept as
    it is)."""

    def __init__(self, prep: Callable[[Any], None], leaves: list, pool=None):
        self._prep = prep
        self._pool = pool
        self.attn_backend_list = leaves
        self.forward_metadata = None

    def init_forward_metadata_out_graph(self, forward_batch) -> None:
        capturing = self._pool is not None and torch.cuda.is_current_stream_capturing()
        with torch.cuda.use_mem_pool(self._pool) if capturing else contextlib.nullcontext():
            self._prep(forward_batch)


def glue_counts(owner, kind: type) -> GlueCounts | None:
    """What the glue of ``owner`` served (``kind``: its state's type, :class:`RunnerState` for a
    decode runner, :class:`BackendState` for the draft-extend backend, :class:`MultiStepState` for
    the multi-step backend); None before it was decided."""
    state = peek(owner, kind).glue
    if state.reason == UNDECIDED:
        return None
    replays = 0 if state.graphs is None else state.graphs.replays
    return GlueCounts(replays, state.padded, Counter(state.eager_by_reason))


def captured_glue(owner, kind: type = BackendState):
    """The ``MetadataGlueGraph`` that serves ``owner``'s replays, or None (``kind``: its state's
    type, as for :func:`glue_counts`)."""
    state = peek(owner, kind).glue
    return None if state.reason is not None else state.graphs


def _decide(state: GlueState, what: str, why_not: Callable[[], str | None], make) -> None:
    """Decide once whether ``state`` glues (``why_not()``; ``make(state)`` sets its prep and
    graphs), logged once."""
    state.what = what
    try:
        reason = why_not()
        if reason is None:
            make(state)
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


def _failed(state: GlueState, exc: Exception) -> None:
    state.reason = f"raised {type(exc).__name__}: {exc}"
    log_failure(
        ("glue-failed", state.what),
        exc,
        "sglang_dsa_mtp: the %s's metadata glue is off from now on (eager prep)",
        state.what,
    )


def _new_graphs(state: GlueState, prep: Callable[[Any], None], leaves: list) -> None:
    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

    device = leaves[0].device
    state.prep = GluedPrep(prep, leaves, glue_pool(device))
    state.graphs = MetadataGlueGraph(device)


def _capture_key(state: GlueState, forward_batch, key) -> None:
    """Run ``forward_batch``'s prep through ``state``'s glue until ``key`` is captured (the glue's
    eager warm-ups, then its capture), and serve ``forward_batch.batch_size`` by ``key`` from then
    on. Not inside a stream capture: then that bs stays eager."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(
            logging.WARNING,
            ("glue-in-capture", key[1:]),
            "sglang_dsa_mtp: DSA graph metadata built inside a stream capture: its replays "
            "keep the eager prep",
        )
        return
    graphs = state.graphs
    while not graphs.disabled and not graphs.is_captured(key):
        graphs.run(state.prep, forward_batch, key)
    if graphs.is_captured(key):
        state.keys[forward_batch.batch_size] = key


def _run(state: GlueState, key, *, padded: bool) -> bool:
    """A replay's prep as the graph ``state``'s glue captured under ``key`` (None: no key was
    captured for this replay) replays it, as SGLang's own route replays a key; False where it did
    not run there (no key, the glue turned itself off, or it raised: that glue off from now on),
    counted, and the caller runs the eager prep, which rewrites every buffer the graph writes."""
    if key is None or state.graphs.disabled:
        state.eager(OFF if state.graphs.disabled else NOT_CAPTURED)
        return False
    try:
        state.graphs.replay(key)
    except Exception as exc:
        _failed(state, exc)
        return False
    state.padded += padded
    return True


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
    if in_capture:
        result = original(self, forward_batch, in_capture=True)
        role = _role(self, forward_batch.forward_mode)
        if role is not None:
            _capture_backend(original, self, forward_batch, role)
        return result
    if forward_batch.forward_mode.is_draft_extend_v2():
        state = state_of(self, BackendState).glue
        if state.reason is None:
            if _run(state, state.keys.get(forward_batch.batch_size), padded=False):
                return None
    return original(self, forward_batch)  # it rewrites every buffer a failed glue wrote


def _capture_backend(original, backend, forward_batch, role: str) -> None:
    state = state_of(backend, BackendState).glue
    mode = forward_batch.forward_mode
    if state.reason == UNDECIDED:
        _decide(
            state,
            role,
            lambda: _why_not_backend(backend, mode),
            lambda s: _new_graphs(s, lambda fb: original(backend, fb), [backend]),
        )
    if state.reason is not None:
        return
    try:
        _capture_key(state, forward_batch, glue_key(forward_batch.batch_size, mode))
    except Exception as exc:
        _failed(state, exc)


# ----------------------------------------------------------------------------------------------
# Target verify and plain decode: the decode runner's route
# ----------------------------------------------------------------------------------------------


def _why_not_runner(runner) -> str | None:
    """Why the decode runner's replays stay eager (each fixed for the runner's life), or None."""
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
    if runner.enable_two_batch_overlap:
        return "two-batch overlap is on (a backend per micro-batch)"
    if runner.model_runner.lora_manager is not None:
        return "LoRA is on (its batch prep runs with the metadata)"
    if sglang_surface.early_verify_metadata(runner) is not None:
        return "SGLang stages this runner's verify metadata early"
    if captured_glue(backend) is None:
        return f"its backend's glue is off ({peek(backend, BackendState).glue.reason})"
    return None


def glue_replay_view_prep(
    original,
    self,
    forward_batch,
    *,
    raw_bs,
    bs,
    num_tokens,
    glue_key,
    attention_variant,
):
    """AROUND ``DecodeCudaGraphRunner._init_replay_attn_metadata_from_view``: a replay its own glue
    route did not replay (its first, a padded one, a key not captured), taking its keywords by
    name (``sglang_surface.VIEW_PREP_KEYWORDS``, probed before the hook is registered: a catch-all
    dict would cost every replay about a microsecond of the GPU host's). At the first, the runner
    decides, and its route is pointed at its backend's glue; a replay of a captured key is that
    graph's replay, padded or not; any other keeps SGLang's eager prep (not SGLang's capture while
    serving)."""
    state = state_of(self, RunnerState)
    glue = state.glue
    if glue.reason == UNDECIDED:
        _decide(
            glue, _runner_role(self), lambda: _why_not_runner(self), lambda _: _route(state, self)
        )
    if glue.reason is None:
        # The key captured for bs is this replay's where it replays the capture mode (_route
        # checked each against SGLang's key of that replay).
        key = glue.keys.get(bs) if forward_batch.forward_mode is self.capture_forward_mode else None
        if _run(glue, key, padded=raw_bs != bs):
            return None
        if glue.reason is not None:  # it raised: the route back to the glue the runner had
            sglang_surface.set_runner_glue_route(self, *state.sglang_route)
        glue_key = None
    return original(
        self,
        forward_batch,
        raw_bs=raw_bs,
        bs=bs,
        num_tokens=num_tokens,
        glue_key=glue_key,
        attention_variant=attention_variant,
    )


def _route(state: RunnerState, runner) -> None:
    """The decode runner served by its backend's glue (its graphs and captured keys), SGLang's
    own glue route pointed at it; the glue the runner had (SGLang's, made by its own switch, not
    used yet: this is its first replay prep) kept to be given back. Each captured key must be the
    key SGLang's route looks up for a replay of the runner's capture mode at its bs."""
    glue, backend = state.glue, peek(runner.attn_backend, BackendState).glue
    mode = runner.capture_forward_mode
    for bs, key in backend.keys.items():
        expected = sglang_surface.replay_glue_key(runner, bs, mode, None)
        if key != expected:
            raise LookupError(
                f"the glue captured bs {bs} as {key}, SGLang replays it as {expected}"
            )
    glue.graphs, glue.keys = backend.graphs, backend.keys
    state.sglang_route = sglang_surface.runner_glue_route(runner)
    sglang_surface.set_runner_glue_route(runner, backend.graphs, skip_view=True)


def _runner_role(runner) -> str:
    mode = str(runner.capture_forward_mode).rsplit(".", 1)[-1].lower().replace("_", " ")
    return f"{mode} runner"


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
            lambda s: _new_graphs(s, eager, list(multi.attn_backends)),
        )
    if state.reason is not None:
        return
    state.inputs[bs] = (forward_batch.seq_lens, forward_batch.req_pool_indices)
    try:
        view = SimpleNamespace(**vars(forward_batch), num_padding=0)  # as a replay hands it
        _capture_key(state, view, (bs,))
    except Exception as exc:
        _failed(state, exc)


def mtp_replay(multi, forward_batch) -> bool:
    """The MTP draft decode's replay prep through its glue; False when it did not run there (the
    caller runs the eager prep). The captured graph reads the input buffers its bs was captured
    with: a padded replay's inputs are those buffers (checked by address), an unpadded replay's
    are the batch's own tensors, whose values the runner has just copied into them."""
    state = peek(multi, MultiStepState).glue
    if state.reason is not None:
        return False
    padded = getattr(forward_batch, "num_padding", 0)
    if padded:
        captured = state.inputs.get(forward_batch.batch_size)
        if (
            captured is None
            or forward_batch.seq_lens.data_ptr() != captured[0].data_ptr()
            or forward_batch.req_pool_indices.data_ptr() != captured[1].data_ptr()
        ):
            state.eager("padded inputs not the captured buffers")
            return False
    return _run(state, state.keys.get(forward_batch.batch_size), padded=bool(padded))
