"""What the plugin keeps on SGLang's objects: one typed state object per object, in one place.

Each SGLang object the hooks decide something about holds one state object in its ``__dict__``,
under :data:`ATTR`: a decode graph runner a :class:`RunnerState`, a DSA attention backend a
:class:`BackendState`, the MTP draft-decode backend a
:class:`MultiStepState`, a model's ``LogitsProcessor`` a :class:`ProcessorState`. A field's
default is what holds before the hook that sets it has run (for instance on an object built before
the plugin's hooks were applied). :func:`state_of` and :func:`peek` check the kind; a glued
replay's hook, on the host's hot path, reads ``obj.__dict__.get(ATTR)`` itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypeVar

ATTR = "_sglang_dsa_mtp"
State = TypeVar("State")


UNDECIDED = "not decided yet"


@dataclass
class GlueCounts:
    """What one runner's metadata glue served: its glue graphs' replays (``routed``, SGLang's own
    count, ``MetadataGlueGraph.replays``; ``padded`` of them), and replays whose prep ran eagerly,
    by reason."""

    routed: int = 0
    padded: int = 0
    eager: Counter = field(default_factory=Counter)


@dataclass
class GlueState:
    """One runner's metadata glue (``dsa_metadata_glue``); a new one replaces it whenever SGLang
    builds its owner's CUDA-graph state again (a recapture)."""

    reason: str | None = UNDECIDED  # why its prep stays eager; None when the glue serves it
    what: str = ""  # the runner or backend, in words (its log lines), named when decided
    # Its GlueGraph and the GluedPrep that graph captures (a decode runner: its backend's graph,
    # shared; it captures nothing, so no prep).
    graphs: Any = None
    prep: Any = None
    # A DSA backend's captured keys: (bs, forward mode) -> SGLang's key.
    keys: dict = field(default_factory=dict)
    # bs -> the key its replays replay (SGLang's): the draft extend's, a decode runner's (its
    # capture mode's keys), the MTP draft decode's.
    replays: dict = field(default_factory=dict)
    # bs -> what its capture read: the MTP draft decode's input buffers (seq_lens,
    # req_pool_indices; until its first padded replay is checked against them); the draft
    # extend's num_accept_tokens address (a padded replay's).
    inputs: dict = field(default_factory=dict)
    uncaptured: dict = field(default_factory=dict)  # bs -> why its key was not captured
    padded: int = 0  # glue graph replays of a padded batch
    eager_by_reason: Counter = field(default_factory=Counter)

    def eager(self, why: str) -> None:
        self.eager_by_reason[why] += 1


@dataclass
class RunnerState:
    """A ``DecodeCudaGraphRunner`` (target verify, plain decode)."""

    glue: GlueState = field(default_factory=GlueState)
    # SGLang's own glue route as the runner had it before it was pointed at the plugin's glue (its
    # glue, None unless SGLANG_ENABLE_METADATA_GLUE_GRAPH made one, and whether it skips the replay
    # view), given back if the plugin's glue fails.
    sglang_route: tuple = (None, False)


@dataclass
class BackendState:
    """A ``DeepseekSparseAttnBackend``: the target's, the draft extend's, or an MTP draft step's."""

    # Why the backend keeps SGLang's replay-metadata kernels; None when ours are selected.
    bounded_reason: str | None = "the plugin's selection hook did not run"
    reported: bool = False  # its start-up line on the replay-metadata kernels is out
    # (is_draft_runner, skip_prefill) as the constructor got them; None before that hook ran.
    runner: tuple[bool, bool] | None = None
    verify_mask: Any = None  # the QLEN_ONLY, not-read VerifyMask it hands out; None: SGLang's
    shared_real_page_table: Any = None  # the one compact table its batch sizes slice, or None
    # On an MTP draft step backend: why it keeps its wide page_table_1; None when it may drop it.
    step_reader: str | None = (
        "a draft step backend built outside DeepseekSparseAttnMultiStepBackend"
    )
    glue: GlueState = field(default_factory=GlueState)  # the draft extend's metadata glue


@dataclass
class DraftDecodeBs:
    """One captured batch size of the MTP draft decode, as decided at its capture."""

    reason: str | None  # why the one launch does not write it; None when it does
    launch: dict | None = None  # the one launch's keyword arguments but the per-replay inputs
    bound: Any = None  # its launch bound at capture (launch.BoundLaunch), or None: the wrapper
    metadata: list | None = None  # every step backend's graph metadata for the batch size
    failed: bool = False  # the reason is a failure, already logged at ERROR


@dataclass
class MultiStepState:
    """A ``DeepseekSparseAttnMultiStepBackend`` (the MTP draft decode's step backends).

    ``batch_sizes`` holds plans on the step backends' graph buffers: it is emptied when SGLang
    builds their graph state again (``init_cuda_graph_state``), and refilled as it captures."""

    seeded: bool | None = (
        None  # seed_dsa_topk_from_draft_extend; None: the constructor hook did not run
    )
    batch_sizes: dict[int, DraftDecodeBs] = field(default_factory=dict)
    one_launch_logged: bool | None = None  # what its start-up line said: one launch on, or off
    steps_dropped: bool = False  # a step backend has no wide page_table_1
    glue: GlueState = field(default_factory=GlueState)  # its metadata glue


@dataclass
class ProcessorState:
    """A model's ``LogitsProcessor``: its vocab-shard argmax exchange in each role (a
    ``VocabShardExchange``), None where it keeps SGLang's path (not opted in, or kept)."""

    draft: Any = None  # the draft model's: greedy-draft calls exchange instead of gathering
    verify: Any = None  # the target model's: target verify keeps its shard, exchanges its argmax


def state_of(obj, kind: type[State]) -> State:
    """``obj``'s state, created with its defaults at the first call. A state of another kind is a
    TypeError (one object, one kind)."""
    state = _stored(obj, kind)
    if state is None:
        state = obj.__dict__[ATTR] = kind()
    return state


def peek(obj, kind: type[State]) -> State:
    """``obj``'s state, or the defaults (not stored) when it has none yet. A state of another kind
    is a TypeError."""
    state = _stored(obj, kind)
    return kind() if state is None else state


def _stored(obj, kind: type[State]) -> State | None:
    state = getattr(obj, "__dict__", {}).get(ATTR)
    if state is not None and not isinstance(state, kind):
        raise TypeError(
            f"{type(obj).__name__} holds a {type(state).__name__} under {ATTR}, not a "
            f"{kind.__name__}"
        )
    return state
