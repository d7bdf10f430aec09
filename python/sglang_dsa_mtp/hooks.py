"""Every effect the plugin has on SGLang, in two tables, and whether SGLang applied them.

``HOOKS`` lists one hook per SGLang function or method (SGLang's ``HookRegistry`` types: BEFORE,
AFTER, AROUND); ``ATTRIBUTES`` the few names the plugin adds to SGLang classes (an opt-in method, a
field default, a property), which ``HookRegistry`` cannot create. Each row names the kill switches
whose features need it; ``plugin.register()`` registers a feature's rows whole or not at all, and a
row two features share once. Hooks are named as ``"<module>:<function>"`` strings and imported only
by ``register()``, so importing this module imports no hook code.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_dsa_mtp.switches import (
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
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
_VERIFY = (VERIFY_ARGMAX_EXCHANGE,)
_DSA = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_MULTI_STEP = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"
_MANAGER = "sglang.srt.layers.attention.dsa.dsa_metadata_manager.DSAMetadataManagementMixin"
_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
_PAGED_MQA = "sglang.kernels.ops.attention.dsa.paged_mqa_logits"
_LOGITS = "sglang.srt.layers.logits_processor"
_EAGLE = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
_EXTEND_RUNNER = (
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner"
)
_TOPK1 = "sglang.kernels.ops.speculative.topk1.draft_topk1_postprocess"
_VERIFY_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
_TREE_GREEDY = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
_OURS = "sglang_dsa_mtp.integration"

HOOKS: tuple[PluginHook, ...] = (
    # Bounded replay-metadata kernels, once SGLang picked its own (CUDA, kpool 1, no KPool fusion),
    # each with SGLang's kernel as its per-bs fallback; compiled as each bs's graph metadata is built.
    PluginHook(
        _BOUNDED,
        f"{_MANAGER}._init_kpool_metadata_fusion",
        HookType.AFTER,
        f"{_OURS}.dsa_metadata_selection:select_bounded_metadata_kernels",
    ),
    PluginHook(
        _BOUNDED,
        f"{_DSA}._build_forward_metadata_cuda_graph",
        HookType.AFTER,
        f"{_OURS}.dsa_metadata_capture:warm_up_captured_bs",
    ),
    # MTP draft decode: the seed flag kept; each replay's metadata in one launch per captured bs
    # (bounded), or per step backend when their wide tables are dropped (live width).
    PluginHook(
        _BOUNDED,
        f"{_MULTI_STEP}.__init__",
        HookType.AROUND,
        f"{_OURS}.dsa_mtp_draft_metadata:keep_seed_flag",
    ),
    PluginHook(
        _BOUNDED + _LIVE,
        f"{_MULTI_STEP}.init_forward_metadata_out_graph",
        HookType.AROUND,
        f"{_OURS}.dsa_mtp_draft_metadata:draft_decode_metadata",
    ),
    # Greedy-draft argmax exchange: an opted-in draft LogitsProcessor all-reduces its shard's argmax
    # partials instead of gathering the logits; the EAGLE v2 draft worker opts in before capturing,
    # then picks its tokens from the partials (draft decode in the graph, draft extend after it).
    # The _get_logits hook serves the target-verify exchange too (its target verify calls).
    PluginHook(
        _EXCHANGE + _VERIFY,
        f"{_LOGITS}.LogitsProcessor._get_logits",
        HookType.AROUND,
        f"{_OURS}.vocab_shard_exchange:exchange_logits",
    ),
    PluginHook(
        _EXCHANGE,
        f"{_LOGITS}.LogitsProcessor.forward",
        HookType.AFTER,
        f"{_OURS}.vocab_shard_exchange:attach_partials",
    ),
    PluginHook(
        _EXCHANGE,
        f"{_EAGLE}._capture_cuda_graphs",
        HookType.BEFORE,
        f"{_OURS}.eagle_argmax:opt_in_draft_model",
    ),
    PluginHook(_EXCHANGE, _TOPK1, HookType.AROUND, f"{_OURS}.eagle_argmax:draft_decode_pick"),
    PluginHook(
        _EXCHANGE,
        f"{_EXTEND_RUNNER}.execute",
        HookType.AROUND,
        f"{_OURS}.eagle_argmax:draft_extend_replay_pick",
    ),
    PluginHook(
        _EXCHANGE,
        f"{_EAGLE}._draft_extend_for_decode",
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
        f"{_EAGLE_V2}.init_attention_backends",
        HookType.AFTER,
        f"{_OURS}.eagle_argmax:opt_in_target_model",
    ),
    PluginHook(_VERIFY, _VERIFY_SAMPLE, HookType.AROUND, f"{_OURS}.eagle_argmax:verify_sample"),
    PluginHook(_VERIFY, _TREE_GREEDY, HookType.AROUND, f"{_OURS}.eagle_argmax:greedy_verify_pick"),
    # Live width, indexer: logits of more rows than SMs joined by their live columns, not a
    # full-width concat; the copy kernel compiled when the indexer is built.
    PluginHook(
        _LIVE,
        f"{_PAGED_MQA}.deepgemm_paged_mqa_logits_split",
        HookType.AROUND,
        f"{_OURS}.dsa_indexer_live_logits:live_width_split",
    ),
    PluginHook(
        _LIVE,
        f"{_INDEXER}.__init__",
        HookType.AFTER,
        f"{_OURS}.dsa_indexer_live_logits:warm_up_live_logits",
    ),
    # Live width, CUDA-graph state: no wide page_table_1 where nothing reads it (SGLang's own drop,
    # its spec clause lifted), else one real_page_table per backend; the DSA target's verify tree
    # mask QLEN_ONLY and not read (no bs x context FULL_MASK per round). The multi-step backend's
    # graph state also drops the one launch's per-bs plans (bounded).
    PluginHook(
        _LIVE, f"{_DSA}.__init__", HookType.AFTER, f"{_OURS}.dsa_verify_mask:remember_runner"
    ),
    PluginHook(
        _LIVE,
        f"{_DSA}.init_cuda_graph_state",
        HookType.AROUND,
        f"{_OURS}.dsa_graph_page_tables:init_graph_state",
    ),
    PluginHook(
        _LIVE,
        f"{_DSA}._init_kpool_metadata_capture",
        HookType.BEFORE,
        f"{_OURS}.dsa_graph_page_tables:capture_into_shared_real_table",
    ),
    PluginHook(
        _BOUNDED + _LIVE,
        f"{_MULTI_STEP}.init_cuda_graph_state",
        HookType.AROUND,
        f"{_OURS}.dsa_graph_page_tables:steps_graph_state",
    ),
)

ATTRIBUTES: tuple[PluginAttribute, ...] = (
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessor.enable_draft_argmax_exchange",
        f"{_OURS}.vocab_shard_exchange:enable_draft_argmax_exchange",
    ),
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessorOutput.next_token_argmax_partials",
        f"{_OURS}.vocab_shard_exchange:NO_PARTIALS",
    ),
    # The DSA backend's own verify_mask property, in front of AttentionBackend's (None).
    PluginAttribute(
        LIVE_WIDTH,
        f"{_DSA}.verify_mask",
        f"{_OURS}.dsa_verify_mask:verify_mask",
        shadows="sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
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
    logs and skips a target that fails to apply). The one place that reads its private
    ``_patched`` set."""
    patched = getattr(HookRegistry, "_patched", set())
    return [row.target for row in rows_of(switch) if row.target not in patched]
