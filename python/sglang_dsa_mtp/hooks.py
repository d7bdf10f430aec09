"""Every effect the plugin has on SGLang, in two tables, and whether SGLang applied them.

``HOOKS`` lists one hook per SGLang function or method (SGLang's ``HookRegistry`` types: BEFORE,
AFTER, AROUND); ``ATTRIBUTES`` the few names the plugin adds to SGLang classes (an opt-in method, a
field default, a property), which ``HookRegistry`` cannot create. Each row names the kill switches
whose features need it; ``plugin.register()`` registers a feature's rows whole or not at all, and a
row two features share once. The targets are named in ``sglang_surface`` (every SGLang name the
plugin hooks, in one place); hooks are named as ``"<module>:<function>"`` strings and imported only
by ``register()``, so importing this module imports no hook code.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.plugins.hook_registry import HookType

from sglang_dsa_mtp import sglang_surface as sg
from sglang_dsa_mtp.switches import (
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    METADATA_GLUE,
    VERIFY_ARGMAX_EXCHANGE,
    KillSwitch,
)


@dataclass(frozen=True)
class PluginHook:
    """One row of the hook table: while any of ``switches`` is on, ``hook`` is registered on
    ``target`` (the dotted path of an SGLang function or method, resolved as ``HookRegistry``
    resolves it). ``hook`` is ``"sglang_dsa_mtp.integration.<module>:<function>"``; a hook serving
    two switches reads both at run time."""

    switches: tuple[KillSwitch, ...]
    target: str
    hook_type: HookType
    hook: str


@dataclass(frozen=True)
class PluginAttribute:
    """One row of the attribute table: while ``switch`` is on, ``target`` is set to ``value``.

    ``target`` is ``"<dotted SGLang class>.<new attribute>"``; the class must not define the attribute
    already (if it does, SGLang has changed and the feature stays off). ``value`` is
    ``"sglang_dsa_mtp.integration.<module>:<name>"``. With ``shadows`` (a dotted SGLang base class),
    the class must instead inherit the attribute from that base, and the row gives the class its own
    definition in front of the inherited one.
    """

    switch: KillSwitch
    target: str
    value: str
    shadows: str | None = None


_BOUNDED, _EXCHANGE, _LIVE = (BOUNDED_REPLAY_METADATA,), (DRAFT_ARGMAX_EXCHANGE,), (LIVE_WIDTH,)
_VERIFY, _GLUE = (VERIFY_ARGMAX_EXCHANGE,), (METADATA_GLUE,)
_OURS = "sglang_dsa_mtp.integration"

HOOKS: tuple[PluginHook, ...] = (
    # Bounded replay-metadata kernels, once SGLang picked its own (CUDA, kpool 1, no KPool fusion),
    # each with SGLang's kernel as its per-bs fallback; compiled as each bs's graph metadata is built.
    PluginHook(
        _BOUNDED,
        sg.INIT_KPOOL_METADATA_FUSION,
        HookType.AFTER,
        f"{_OURS}.dsa_metadata_selection:select_bounded_metadata_kernels",
    ),
    PluginHook(
        _BOUNDED,
        sg.BUILD_FORWARD_METADATA_CUDA_GRAPH,
        HookType.AFTER,
        f"{_OURS}.dsa_metadata_capture:warm_up_captured_bs",
    ),
    # MTP draft decode: the seed flag kept; each replay's metadata in one launch per captured bs
    # (bounded), or per step backend when their wide tables are dropped (live width).
    PluginHook(
        _BOUNDED,
        sg.MULTI_STEP_INIT,
        HookType.AROUND,
        f"{_OURS}.dsa_mtp_draft_metadata:keep_seed_flag",
    ),
    PluginHook(
        _BOUNDED + _LIVE + _GLUE,
        sg.MULTI_STEP_METADATA,
        HookType.AROUND,
        f"{_OURS}.dsa_mtp_draft_metadata:draft_decode_metadata",
    ),
    # Greedy-draft argmax exchange: an opted-in draft LogitsProcessor all-reduces its shard's argmax
    # partials instead of gathering the logits; the EAGLE v2 draft worker opts in before capturing,
    # then picks its tokens from the partials (draft decode in the graph, draft extend after it).
    # The _get_logits hook serves the target-verify exchange too (its target verify calls).
    PluginHook(
        _EXCHANGE + _VERIFY,
        sg.GET_LOGITS,
        HookType.AROUND,
        f"{_OURS}.vocab_shard_exchange:exchange_logits",
    ),
    PluginHook(
        _EXCHANGE,
        sg.LOGITS_FORWARD,
        HookType.AFTER,
        f"{_OURS}.vocab_shard_exchange:attach_partials",
    ),
    PluginHook(
        _EXCHANGE,
        sg.CAPTURE_DRAFT_GRAPHS,
        HookType.BEFORE,
        f"{_OURS}.eagle_argmax:opt_in_draft_model",
    ),
    PluginHook(
        _EXCHANGE,
        sg.DRAFT_TOPK1_POSTPROCESS,
        HookType.AROUND,
        f"{_OURS}.eagle_argmax:draft_decode_pick",
    ),
    PluginHook(
        _EXCHANGE,
        sg.DRAFT_EXTEND_EXECUTE,
        HookType.AROUND,
        f"{_OURS}.eagle_argmax:draft_extend_replay_pick",
    ),
    PluginHook(
        _EXCHANGE,
        sg.DRAFT_EXTEND_FOR_DECODE,
        HookType.AROUND,
        f"{_OURS}.eagle_argmax:draft_extend_for_decode",
    ),
    # Target-verify argmax exchange (beyond the spec): the EAGLE v2 worker opts the target's
    # LogitsProcessor in before any capture; in target verify it keeps its vocab shard and picks
    # the argmax from exchanged partials in the graph; SGLang's verify reads that argmax for greedy
    # batches nothing else reads the logits of, and gets the full logits gathered after the replay
    # for any other batch.
    PluginHook(
        _VERIFY,
        sg.INIT_ATTENTION_BACKENDS,
        HookType.AFTER,
        f"{_OURS}.eagle_argmax:opt_in_target_model",
    ),
    PluginHook(_VERIFY, sg.EAGLE_SAMPLE, HookType.AROUND, f"{_OURS}.eagle_argmax:verify_sample"),
    PluginHook(
        _VERIFY, sg.VERIFY_TREE_GREEDY, HookType.AROUND, f"{_OURS}.eagle_argmax:greedy_verify_pick"
    ),
    # Live width, indexer: logits of more rows than SMs joined by their live columns, not a
    # full-width concat; the copy kernel compiled when the indexer is built.
    PluginHook(
        _LIVE,
        sg.PAGED_MQA_LOGITS_SPLIT,
        HookType.AROUND,
        f"{_OURS}.dsa_indexer_live_logits:live_width_split",
    ),
    PluginHook(
        _LIVE,
        sg.INDEXER_INIT,
        HookType.AFTER,
        f"{_OURS}.dsa_indexer_live_logits:warm_up_live_logits",
    ),
    # Live width, CUDA-graph state: no wide page_table_1 where nothing reads it (SGLang's own drop,
    # its spec clause lifted), else one real_page_table per backend; the DSA target's verify tree
    # mask QLEN_ONLY and not read (no bs x context FULL_MASK per round). Both graph-state hooks
    # also drop what was kept on the state being replaced (bounded: bound launches, the one
    # launch's per-bs plans; glue: its graphs and keys), at start-up and at every recapture.
    PluginHook(_LIVE, sg.DSA_INIT, HookType.AFTER, f"{_OURS}.dsa_verify_mask:remember_runner"),
    PluginHook(
        _BOUNDED + _LIVE + _GLUE,
        sg.DSA_INIT_CUDA_GRAPH_STATE,
        HookType.AROUND,
        f"{_OURS}.dsa_graph_page_tables:init_graph_state",
    ),
    PluginHook(
        _LIVE,
        sg.INIT_KPOOL_METADATA_CAPTURE,
        HookType.BEFORE,
        f"{_OURS}.dsa_graph_page_tables:capture_into_shared_real_table",
    ),
    PluginHook(
        _BOUNDED + _LIVE + _GLUE,
        sg.MULTI_STEP_INIT_CUDA_GRAPH_STATE,
        HookType.AROUND,
        f"{_OURS}.dsa_graph_page_tables:steps_graph_state",
    ),
    # Metadata glue (beyond the spec): every DSA runner's replay prep, padded replays too, through
    # SGLang's MetadataGlueGraph: the decode runner's own route (target verify, plain decode; the
    # replays it leaves to its replay view here), a glue per draft runner held by the plugin (draft
    # extend here, MTP draft decode above).
    PluginHook(
        _GLUE,
        sg.DECODE_RUNNER_VIEW_PREP,
        HookType.AROUND,
        f"{_OURS}.dsa_metadata_glue:glue_replay_view_prep",
    ),
    PluginHook(
        _GLUE,
        sg.DSA_METADATA_OUT_GRAPH,
        HookType.AROUND,
        f"{_OURS}.dsa_metadata_glue:dsa_prep",
    ),
)

ATTRIBUTES: tuple[PluginAttribute, ...] = (
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{sg.LOGITS_PROCESSOR}.enable_draft_argmax_exchange",
        f"{_OURS}.vocab_shard_exchange:enable_draft_argmax_exchange",
    ),
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{sg.LOGITS_PROCESSOR_OUTPUT}.next_token_argmax_partials",
        f"{_OURS}.vocab_shard_exchange:NO_PARTIALS",
    ),
    # The DSA backend's own verify_mask property, in front of AttentionBackend's (None).
    PluginAttribute(
        LIVE_WIDTH,
        f"{sg.DSA}.verify_mask",
        f"{_OURS}.dsa_verify_mask:verify_mask",
        shadows=sg.ATTENTION_BACKEND,
    ),
)


def rows_of(switch: KillSwitch) -> tuple[PluginHook, ...]:
    """The hook rows ``switch``'s feature needs."""
    return tuple(row for row in HOOKS if switch in row.switches)


def attributes_of(switch: KillSwitch) -> tuple[PluginAttribute, ...]:
    """The attribute rows ``switch``'s feature needs."""
    return tuple(row for row in ATTRIBUTES if row.switch is switch)


def why_off(switch: KillSwitch) -> str | None:
    """Why ``switch``'s feature cannot engage in this process: the switch or the platform
    (``switch.blocker()``), or a hook of the feature that SGLang did not apply; None when it can."""
    blocker = switch.blocker()
    if blocker is not None:
        return blocker
    unapplied = unapplied_hooks(switch)
    if unapplied:
        return f"SGLang did not apply the plugin's hooks on {', '.join(unapplied)}"
    return None


def unapplied_hooks(switch: KillSwitch) -> list[str]:
    """The targets of ``switch``'s hook rows that SGLang's ``HookRegistry`` has not patched (it
    logs and skips a target that fails to apply)."""
    patched = sg.patched_targets()
    return [row.target for row in rows_of(switch) if row.target not in patched]
