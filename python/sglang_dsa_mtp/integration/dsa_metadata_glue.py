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
while serving. Keys are SGLang's (bs, capture mode, replay mode): each runner replays its own mode's.
Glued are only the preps docs/glue-audit.md proves constant per key and whose captures keep no
table as wide as the context (``dsa_index_kpool`` 1; the MTP draft decode where the one launch or
each step's own replay writes it), and no server whose decode graphs are breakable, overlap two
batches, run pdmux, or whose torch would not put capture allocations in the shared pool (probed).
Each glue is a :class:`GlueGraph` (SGLang's class, its replay kept to one frame) of a
:class:`GluedPrep` (the prep and the backends whose ``forward_metadata`` it snapshots). When SGLang
builds a backend's CUDA-graph state again (a recapture), :func:`reset_glue` drops its glue, keys and
recorded inputs. A glue whose capture raises turns itself off for its runner (SGLang's class); any
other exception at a hook site sends that runner to the eager prep for good, logged once at ERROR
(a decode runner's route then goes back to the glue it had). That catches what is raised on the
host: a device fault in a glue graph is sticky, and an unpadded decode replay of a captured key
runs in SGLang's route with no code of the plugin's, so no fallback of the plugin's exists there.
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
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.state import (
    ATTR,
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
PRECOMPUTE = "SGLang's precompute + copies write it (bs x width temporaries in a capture)"
DRAFT_EXTEND_V2 = ForwardMode.DRAFT_EXTEND_V2  # a module constant: an enum member's lookup costs

# CUDA device index -> (the torch.cuda.MemPool its glue graphs share, or None; why not, or None)
_POOLS: dict[int, tuple[Any, str | None]] = {}


def glue_pool(device) -> tuple[Any, str | None]:
    """The memory pool every glue graph on ``device`` allocates in while it captures, and None; or
    None and why there is none (off CUDA: (None, None)). Made and probed at the first call. One
    pool for all keys of all runners: a glue graph's temporaries are free again when its capture
    ends, so the next capture reuses them, and what a prep keeps (its metadata, snapshotted by the
    glue) stays allocated, so no other capture takes it. The graphs replay one at a time on the
    runner's stream, each before the forward that reads it; nothing outside a glue capture
    allocates in the pool."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _POOLS:
        pool = torch.cuda.MemPool()
        reason = _pool_probe(pool, torch.device("cuda", index))
        _POOLS[index] = (None, reason) if reason else (pool, None)
    return _POOLS[index]


def _pool_probe(pool, device: torch.device) -> str | None:
    """Why an allocation inside a glue capture would not land in ``pool``, or None. Two captures,
    each as a glue captures a key (its graph's own pool first, then ``pool`` made current), each
    allocating: both allocations must be ``pool``'s. Torch picks among the pools of captures under
    way by its own search order; where it picks the graph's, every key would keep a pool of its
    own."""
    stream = torch.cuda.Stream(device)
    kept, graphs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            with torch.cuda.use_mem_pool(pool, device):
                kept.append(torch.empty(1024, dtype=torch.uint8, device=device))
        graphs.append(graph)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
    outside = [t for t in kept if not any(lo <= t.data_ptr() < hi for lo, hi in segments)]
    if outside:
        return (
            f"torch {torch.__version__} put {len(outside)} of 2 probe allocations made inside a "
            "glue capture outside the glue's shared pool (each key would keep a pool of its own)"
        )
    return None


class GluedPrep:
    """A prep as ``MetadataGlueGraph.run`` takes a backend: ``prep(fb)`` runs it, in ``pool`` while
    a stream captures (:func:`glue_pool`); at capture the glue snapshots the ``forward_metadata``
    of ``attn_backend_list`` and puts it back at every replay (this object's own is None, not
    reinstalled by :class:`GlueGraph`)."""

    def __init__(self, prep: Callable[[Any], None], leaves: list, pool=None):
        self._prep = prep
        self._pool = pool
        self.attn_backend_list = leaves
        self.forward_metadata = None

    def init_forward_metadata_out_graph(self, forward_batch) -> None:
        capturing = self._pool is not None and torch.cuda.is_current_stream_capturing()
        with torch.cuda.use_mem_pool(self._pool) if capturing else contextlib.nullcontext():
            self._prep(forward_batch)


class GlueGraph(MetadataGlueGraph):
    """SGLang's ``MetadataGlueGraph`` (its warm-ups, capture, turning itself off, counters; SGLang's
    decode runner takes it as its own), with a replay of one frame: each captured key's graph
    replay and its metadata stores kept at hand when it is captured, ``is_captured`` a dict's own
    ``__contains__``. Its stores leave out the ``GluedPrep`` (its metadata is None)."""

    def __init__(self, device):
        super().__init__(device)
        self._ready: dict = {}  # key -> (the CUDAGraph's bound replay, [(backend, metadata)])
        self.is_captured = self._ready.__contains__

    def reset(self) -> None:
        super().reset()
        self._ready.clear()

    def run(self, attn_backend, fb_view, key) -> None:
        super().run(attn_backend, fb_view, key)
        if self.disabled:
            self._ready.clear()
            return
        captured = sglang_surface.glue_capture(self, key)
        if captured is not None and key not in self._ready:
            graph, meta = captured
            stores = [(b, m) for b, m in meta if b is not attn_backend]
            self._ready[key] = (graph.replay, stores)

    def replay(self, key) -> None:
        replay, stores = self._ready[key]
        for backend, metadata in stores:
            backend.forward_metadata = metadata
        replay()
        self.replays += 1


def glue_counts(owner, kind: type) -> GlueCounts | None:
    """What the glue of ``owner`` served (``kind``: its state's type, :class:`RunnerState` for a
    decode runner, :class:`BackendState` for the draft-extend backend, :class:`MultiStepState` for
    the multi-step backend) since its graph state was last built; None before it was decided."""
    state = peek(owner, kind).glue
    if state.reason == UNDECIDED:
        return None
    replays = 0 if state.graphs is None else state.graphs.replays
    return GlueCounts(replays, state.padded, Counter(state.eager_by_reason))


def captured_glue(owner, kind: type = BackendState):
    """The ``GlueGraph`` that serves ``owner``'s replays, or None (``kind``: its state's type, as
    for :func:`glue_counts`)."""
    state = peek(owner, kind).glue
    return None if state.reason is not None else state.graphs


def reset_glue(owner, kind: type) -> None:
    """SGLang builds ``owner``'s CUDA-graph state again (a recapture: new metadata buffers): its
    glue graphs, keys and recorded inputs are dropped (what their snapshots held is freed), and its
    next capture decides and captures anew. A decode runner is new at a recapture: nothing of its
    own to drop."""
    holder = peek(owner, kind)
    if holder.glue.graphs is not None:
        holder.glue.graphs.reset()
    if holder.glue.reason != UNDECIDED:
        state_of(owner, kind).glue = GlueState()


def _why_not_server(device) -> str | None:
    """Why no runner of this server glues its prep (the switch, the graph backend, DFlash-family
    speculation, a backend per micro-batch or stream, the shared pool), or None."""
    reason = why_off(METADATA_GLUE)
    if reason is not None:
        return reason
    if sglang_surface.breakable_decode_graphs():
        return (
            "breakable decode graphs run attention eagerly within a replay, reading the prefill "
            "choice (use_mha) that the prep resets and a glued replay does not"
        )
    if sglang_surface.dflash_family_speculation():
        return "DFlash-family speculative decoding (its verify plans are fed from the host)"
    reason = sglang_surface.backend_per_batch_part()
    if reason is not None:
        return reason
    return glue_pool(device)[1]


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
    """A glue graph's replay (or a capture of the plugin's) raised on the host: that glue is off
    from now on, logged once, and the caller runs the eager prep, which rewrites every buffer the
    graph writes. Each hook replays a key as SGLang's own route does (``state.graphs.replay(key)``)
    inside its own ``try``: a helper's frame would cost the GPU host's Python a fifth of a
    microsecond per replay. A device fault inside a replay is no exception here: CUDA's error is
    sticky, and the eager prep would meet it too."""
    state.reason = f"raised {type(exc).__name__}: {exc}"
    state.replays.clear()
    log_failure(
        ("glue-failed", state.what),
        exc,
        "sglang_dsa_mtp: the %s's metadata glue is off from now on (eager prep)",
        state.what,
    )


def _new_graphs(state: GlueState, prep: Callable[[Any], None], leaves: list) -> None:
    device = leaves[0].device
    state.prep = GluedPrep(prep, leaves, glue_pool(device)[0])
    state.graphs = GlueGraph(device)


def _capture_key(state: GlueState, forward_batch, key) -> bool:
    """Run ``forward_batch``'s prep through ``state``'s glue until ``key`` is captured (the glue's
    eager warm-ups, then its capture); whether it was. Not inside a stream capture: then that bs
    stays eager."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(
            logging.WARNING,
            ("glue-in-capture", key[1:]),
            "sglang_dsa_mtp: DSA graph metadata built inside a stream capture: its replays "
            "keep the eager prep",
        )
        return False
    graphs = state.graphs
    while not graphs.disabled and not graphs.is_captured(key):
        graphs.run(state.prep, forward_batch, key)
    if graphs.disabled:  # its graphs are gone: no key of it replays
        state.keys.clear()
        state.replays.clear()
    return graphs.is_captured(key)


def _not_glued(state: GlueState, bs: int) -> None:
    """A replay of ``bs`` that no key of ``state``'s glue serves, counted with the reason."""
    state.eager(OFF if state.graphs.disabled else state.uncaptured.get(bs, NOT_CAPTURED))


# ----------------------------------------------------------------------------------------------
# A DSA backend: capture for its runner; the draft extend's replays
# ----------------------------------------------------------------------------------------------


def _why_not_backend(backend) -> str | None:
    """Why a DSA backend's preps stay eager (each fixed for the server's life), or None: glued are
    only the preps whose every line docs/glue-audit.md proves constant per key and whose captures
    keep no table as wide as the context."""
    reason = _why_not_server(backend.device)
    if reason is not None:
        return reason
    if backend.dsa_index_kpool != 1:
        return (
            f"dsa_index_kpool is {backend.dsa_index_kpool}: its preps gather bs x width tables "
            "inside a capture, and the draft extend's reads the round's own num_accept_tokens"
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
    """AROUND ``DeepseekSparseAttnBackend.init_forward_metadata_out_graph``. A replay's prep is
    glued here for the draft extend alone (its runner calls this prep directly); the decode
    runner's glued replays never reach it. A replay reads the backend's state as stored
    (``ATTR``; the hooks store only a :class:`BackendState` on a DSA backend)."""
    if in_capture:
        result = original(self, forward_batch, in_capture=True)
        role = _role(self, forward_batch.forward_mode)
        if role is not None:
            _capture_backend(original, self, forward_batch, role)
        return result
    held = self.__dict__.get(ATTR)
    if (
        held is not None
        and held.glue.reason is None
        and forward_batch.forward_mode is DRAFT_EXTEND_V2
    ):
        glue, bs = held.glue, forward_batch.batch_size
        key = glue.replays.get(bs)
        if key is None:
            _not_glued(glue, bs)
        else:
            try:
                glue.graphs.replay(key)
            except Exception as exc:
                _failed(glue, exc)
            else:
                accepted = getattr(forward_batch.spec_info, "num_accept_tokens", None)
                glue.padded += accepted is not None and accepted.data_ptr() == glue.inputs[bs]
                return None
    return original(self, forward_batch)  # it rewrites every buffer a failed glue wrote


TARGET_ROLES = ("target-verify backend", "decode backend")
LORA = "LoRA is on (the target model's adapters: its decode runner keeps the eager prep)"


def _why_not_role(backend, role: str) -> str | None:
    """Why a DSA backend's preps for ``role`` stay eager, or None: the backend's reasons, and for
    the target's roles LoRA (only the target is adapted, and its runner keeps the eager prep)."""
    reason = _why_not_backend(backend)
    if reason is None and role in TARGET_ROLES and sglang_surface.lora_enabled():
        return LORA
    return reason


def _capture_backend(original, backend, forward_batch, role: str) -> None:
    state = state_of(backend, BackendState).glue
    if state.reason == UNDECIDED:
        _decide(
            state,
            role,
            lambda: _why_not_role(backend, role),
            lambda s: _new_graphs(s, lambda fb: original(backend, fb), [backend]),
        )
    if state.reason is not None:
        return
    bs, mode = forward_batch.batch_size, forward_batch.forward_mode
    key = glue_key(bs, mode)
    try:
        if not _capture_key(state, forward_batch, key):
            return
        state.keys[bs, mode] = key
        if mode.is_draft_extend_v2():  # a padded replay reads the capture's accept lengths
            accepted = getattr(forward_batch.spec_info, "num_accept_tokens", None)
            state.inputs[bs] = None if accepted is None else accepted.data_ptr()
            state.replays[bs] = key
    except Exception as exc:
        _failed(state, exc)


# ----------------------------------------------------------------------------------------------
# Target verify and plain decode: the decode runner's route
# ----------------------------------------------------------------------------------------------

OTHER_MODE = "a replay in another forward mode than the runner captured (IDLE)"


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
    route did not replay (its first, a padded one, a key not captured, another mode), taking its
    keywords by name (``sglang_surface.VIEW_PREP_KEYWORDS``, probed before the hook is registered:
    a catch-all dict would cost every replay about a microsecond of the GPU host's). At the first,
    the runner decides, and its route is pointed at its backend's glue; a replay of a captured key
    of the capture mode is that graph's replay, padded or not; any other keeps SGLang's eager prep
    (not SGLang's capture while serving). A decided runner's state is read as stored (``ATTR``;
    the hooks store only a :class:`RunnerState` on a decode runner)."""
    state = self.__dict__.get(ATTR)
    if state is None or state.glue.reason is UNDECIDED:
        state = state_of(self, RunnerState)
        _decide(
            state.glue,
            _runner_role(self),
            lambda: _why_not_runner(self),
            lambda _: _route(state, self),
        )
    glue = state.glue
    if glue.reason is None:
        key = glue.replays.get(bs)
        if forward_batch.forward_mode is not self.capture_forward_mode:
            glue.eager(OTHER_MODE)
        elif key is None:
            _not_glued(glue, bs)
        else:
            try:
                glue.graphs.replay(key)
            except Exception as exc:
                _failed(glue, exc)  # and the route back to the glue the runner had
                sglang_surface.set_runner_glue_route(self, *state.sglang_route)
            else:
                glue.padded += raw_bs != bs
                return None
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
    """The decode runner served by its backend's glue (its graph and the keys captured in the
    runner's capture mode), SGLang's own glue route pointed at it; the glue the runner had
    (SGLang's, made by its own switch, not used yet: this is its first replay prep) kept to be
    given back. Each key must be the key SGLang's route looks up for a replay of the runner's
    capture mode at its bs."""
    glue, backend = state.glue, peek(runner.attn_backend, BackendState).glue
    mode = runner.capture_forward_mode
    keys = {bs: key for (bs, captured), key in backend.keys.items() if captured == mode}
    for bs, key in keys.items():
        expected = sglang_surface.replay_glue_key(runner, bs, mode, None)
        if key != expected:
            raise LookupError(
                f"the glue captured bs {bs} as {key}, SGLang replays it as {expected}"
            )
    glue.graphs = backend.graphs
    glue.replays = keys
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
    (``eager(fb)``) as a replay runs it. A bs that SGLang's precompute + copies write stays eager
    (they allocate bs x width temporaries, which a capture would keep)."""
    holder = state_of(multi, MultiStepState)
    state, bs = holder.glue, forward_batch.batch_size
    if state.reason == UNDECIDED:
        _decide(
            state,
            "MTP draft-decode backend",
            lambda: _why_not_backend(multi.attn_backends[0]),
            lambda s: _new_graphs(s, eager, list(multi.attn_backends)),
        )
    if state.reason is not None:
        return
    plan = holder.batch_sizes.get(bs)
    if not holder.steps_dropped and (plan is None or plan.reason is not None):
        state.uncaptured[bs] = PRECOMPUTE
        return
    state.inputs[bs] = (forward_batch.seq_lens, forward_batch.req_pool_indices)
    try:
        view = SimpleNamespace(**vars(forward_batch), num_padding=0)  # as a replay hands it
        if _capture_key(state, view, (bs,)):
            state.replays[bs] = (bs,)
    except Exception as exc:
        _failed(state, exc)


NOT_CAPTURED_BUFFERS = "padded inputs not the captured buffers"


def mtp_replay(multi, forward_batch) -> bool:
    """The MTP draft decode's replay prep through its glue; False when it did not run there (the
    caller runs the eager prep). The captured graph reads the input buffers its bs was captured
    with: an unpadded replay's inputs are the batch's own tensors, whose values the runner has just
    copied into them; a padded replay's are those buffers, checked by address at the first padded
    replay of each bs (the runner's buffers stay until a recapture, which drops the glue). A
    replay reads the backend's state as stored (``ATTR``; the hooks store only a
    :class:`MultiStepState` on the multi-step backend)."""
    held = multi.__dict__.get(ATTR)
    if held is None or held.glue.reason is not None:
        return False
    glue, bs = held.glue, forward_batch.batch_size
    key = glue.replays.get(bs)
    if key is None:
        _not_glued(glue, bs)
        return False
    padded = getattr(forward_batch, "num_padding", 0)
    if padded and bs in glue.inputs:
        seq_lens, slots = glue.inputs[bs]
        if (
            forward_batch.seq_lens.data_ptr() != seq_lens.data_ptr()
            or forward_batch.req_pool_indices.data_ptr() != slots.data_ptr()
        ):
            glue.eager(NOT_CAPTURED_BUFFERS)
            return False
        del glue.inputs[bs]  # checked: its padded replays hand the captured buffers
    try:
        glue.graphs.replay(key)
    except Exception as exc:
        _failed(glue, exc)
        return False
    glue.padded += padded != 0
    return True
