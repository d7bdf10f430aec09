"""Every SGLang 0.5.23 name the plugin hooks, and every private one it reads or calls, in one place.

SGLang's public interface does not reach what the plugin changes: the hooks sit on SGLang's methods
(private ones among them) and the hook sites call private helpers of SGLang's classes. Each such
name is declared here once, in :data:`SURFACE`, with the kill switches whose features need it; the
integration modules reach a private name only through this module's functions (a test fails on a
private SGLang name used anywhere else). ``plugin.register()`` probes the surface once
(:func:`missing`): a name the installed SGLang lacks turns off every feature that needs it, SGLang
keeping its own path there, and one log line names it. The next SGLang release is an audit of this
file, not of the whole tree.

A name is probed by resolving it as SGLang's ``HookRegistry`` resolves a target (the module by
``pkgutil``, then ``getattr``); an attribute an SGLang class sets on its instances is probed by its
store in the class's ``__init__``; a function whose keywords a hook names one by one, by its
keyword-only parameters.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass

from sglang_dsa_mtp.switches import (
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    METADATA_GLUE,
    VERIFY_ARGMAX_EXCHANGE,
    KillSwitch,
)

# SGLang's classes and modules the names below belong to.
DSA = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
DSA_MODULE = "sglang.srt.layers.attention.dsa_backend"
MULTI_STEP = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"
MANAGER = "sglang.srt.layers.attention.dsa.dsa_metadata_manager.DSAMetadataManagementMixin"
INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
PAGED_MQA = "sglang.kernels.ops.attention.dsa.paged_mqa_logits"
METADATA_COPIES = "sglang.kernels.ops.attention.dsa.fused_metadata_copy"
LOGITS = "sglang.srt.layers.logits_processor"
EAGLE_DRAFT = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
EXTEND_RUNNER = (
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner"
)
DECODE_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
GROUP = "sglang.srt.distributed.parallel_state.GroupCoordinator"
CUSTOM_ALL_REDUCE_V2 = (
    "sglang.srt.distributed.device_communicators.custom_all_reduce_v2.CustomAllReduceV2"
)
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
GLUE_GRAPH = "sglang.srt.model_executor.runner.metadata_glue_graph.MetadataGlueGraph"

_BOUNDED, _DRAFT, _VERIFY, _LIVE, _GLUE = (
    (BOUNDED_REPLAY_METADATA,),
    (DRAFT_ARGMAX_EXCHANGE,),
    (VERIFY_ARGMAX_EXCHANGE,),
    (LIVE_WIDTH,),
    (METADATA_GLUE,),
)
_EXCHANGES = _DRAFT + _VERIFY
_ALL = _BOUNDED + _EXCHANGES + _LIVE + _GLUE


@dataclass(frozen=True)
class Name:
    """One SGLang name: its dotted ``path``, the ``switches`` whose features need it, and what the
    plugin does with it (``use``). ``instance``: an attribute SGLang's class sets in ``__init__``;
    ``keywords``: a function whose keyword-only parameters a hook names one by one.
    """

    path: str
    switches: tuple[KillSwitch, ...]
    use: str
    instance: bool = False
    keywords: tuple[str, ...] = ()  # a function's keyword-only parameters, exactly these


# --- the hook targets (hooks.HOOKS names them through these) --------------------------------------

INIT_KPOOL_METADATA_FUSION = f"{MANAGER}._init_kpool_metadata_fusion"
BUILD_FORWARD_METADATA_CUDA_GRAPH = f"{DSA}._build_forward_metadata_cuda_graph"
INIT_KPOOL_METADATA_CAPTURE = f"{DSA}._init_kpool_metadata_capture"
DSA_INIT = f"{DSA}.__init__"
DSA_INIT_CUDA_GRAPH_STATE = f"{DSA}.init_cuda_graph_state"
MULTI_STEP_INIT = f"{MULTI_STEP}.__init__"
MULTI_STEP_METADATA = f"{MULTI_STEP}.init_forward_metadata_out_graph"
MULTI_STEP_INIT_CUDA_GRAPH_STATE = f"{MULTI_STEP}.init_cuda_graph_state"
PAGED_MQA_LOGITS_SPLIT = f"{PAGED_MQA}.deepgemm_paged_mqa_logits_split"
INDEXER_INIT = f"{INDEXER}.__init__"
GET_LOGITS = f"{LOGITS}.LogitsProcessor._get_logits"
LOGITS_FORWARD = f"{LOGITS}.LogitsProcessor.forward"
CAPTURE_DRAFT_GRAPHS = f"{EAGLE_DRAFT}._capture_cuda_graphs"
DRAFT_EXTEND_FOR_DECODE = f"{EAGLE_DRAFT}._draft_extend_for_decode"
DRAFT_TOPK1_POSTPROCESS = "sglang.kernels.ops.speculative.topk1.draft_topk1_postprocess"
DRAFT_EXTEND_EXECUTE = f"{EXTEND_RUNNER}.execute"
INIT_ATTENTION_BACKENDS = f"{EAGLE_V2}.init_attention_backends"
EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
VERIFY_TREE_GREEDY = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
DECODE_RUNNER_VIEW_PREP = f"{DECODE_RUNNER}._init_replay_attn_metadata_from_view"
DSA_METADATA_OUT_GRAPH = f"{DSA}.init_forward_metadata_out_graph"
# The keyword-only parameters of the decode runner's replay prep through its replay view, which
# its hook names.
VIEW_PREP_KEYWORDS = ("raw_bs", "bs", "num_tokens", "glue_key", "attention_variant")

# The classes that get an attribute of the plugin's (hooks.ATTRIBUTES).
LOGITS_PROCESSOR = f"{LOGITS}.LogitsProcessor"
LOGITS_PROCESSOR_OUTPUT = f"{LOGITS}.LogitsProcessorOutput"
ATTENTION_BACKEND = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"

# --- the private names the hook sites read or call -------------------------------------------------


def _names(switches: tuple[KillSwitch, ...], use: str, *paths: str, instance=()) -> tuple:
    return tuple(Name(path, switches, use, path in instance) for path in paths)


SURFACE: tuple[Name, ...] = (
    *_names(_ALL, "which hook targets SGLang patched (hooks.why_off)", f"{HOOK_REGISTRY}._patched"),
    *_names(
        _BOUNDED,
        "the replay's page-table width; the MTP steps' 2-D context lengths, indexer plans (DeepGEMM "
        "schedule, top-k v2 plan) and FlashMLA metadata; SGLang's MTP copies, loaded before a "
        "replay can fall back to them",
        f"{DSA}._graph_page_table_width",
        f"{DSA_MODULE}._to_2d_context_lens",
        f"{DSA}._refresh_paged_mqa_schedule_metadata",
        f"{DSA}._refresh_topk_v2_plan",
        f"{DSA}._compute_flashmla_metadata",
        f"{METADATA_COPIES}._jit_fused_metadata_copy_module",
        f"{METADATA_COPIES}._jit_fused_metadata_copy_multi_module",
    ),
    *_names(
        _LIVE,
        "the method whose closure _chunked_fp8_paged_mqa_logits the live copy recognises",
        f"{INDEXER}._get_topk_paged",
    ),
    *_names(
        _EXCHANGES,
        "the rank's LM-head shard logits; the processor's logits gather, run ahead and for a "
        "batch that needs full logits; which all-reduce takes the exchange buffer in a capture",
        f"{LOGITS_PROCESSOR}._compute_lm_head",
        f"{LOGITS_PROCESSOR}._logits_gatherer",
        f"{GROUP}._can_use_flashinfer_allreduce",
        f"{GROUP}._resolve_outplace_all_reduce_method",
        f"{CUSTOM_ALL_REDUCE_V2}._pick_config",
        f"{CUSTOM_ALL_REDUCE_V2}._is_graph_mode_supported",
        instance=(
            f"{LOGITS_PROCESSOR}._logits_gatherer",
            f"{CUSTOM_ALL_REDUCE_V2}._is_graph_mode_supported",
        ),
    ),
    *_names(
        _VERIFY,
        "the cast of the verify's full logits into SGLang's logits buffer",
        f"{LOGITS_PROCESSOR}._copy_logits_to_buffer",
    ),
    *_names(
        _GLUE,
        "the decode runner's early-staged verify metadata, whose runner keeps SGLang's own glue",
        f"{DECODE_RUNNER}._early_verify_metadata",
        instance=(f"{DECODE_RUNNER}._early_verify_metadata",),
    ),
    *_names(
        _GLUE,
        "the decode runner's own glue route: its replay prep replays a captured key of its "
        "_metadata_glue for an unpadded batch, with _skip_glued_replay_view without the replay "
        "view; the key of a replay",
        f"{DECODE_RUNNER}._init_replay_attn_metadata",
        f"{DECODE_RUNNER}._metadata_glue",
        f"{DECODE_RUNNER}._skip_glued_replay_view",
        f"{DECODE_RUNNER}._glue_key",
        instance=(f"{DECODE_RUNNER}._metadata_glue", f"{DECODE_RUNNER}._skip_glued_replay_view"),
    ),
    *_names(
        _GLUE,
        "a captured key's graph and metadata snapshot, which the glue's replay keeps at hand",
        f"{GLUE_GRAPH}._states",
        instance=(f"{GLUE_GRAPH}._states",),
    ),
    Name(
        DECODE_RUNNER_VIEW_PREP,
        _GLUE,
        "the replay prep through the replay view, whose keyword-only parameters the glue's hook "
        "takes by name",
        keywords=VIEW_PREP_KEYWORDS,
    ),
)

# SGLang's models whose forward returns the LogitsProcessor's output untouched (read in 0.5.23; the
# targets' forward is DeepseekV2ForCausalLM.forward, which the others inherit): the argmax
# exchanges engage only for these.
DRAFT_MODELS = (
    "sglang.srt.models.deepseek_nextn.DeepseekV3ForCausalLMNextN",
    "sglang.srt.models.glm4_moe.GlmMoeDsaForCausalLMNextN",
    "sglang.srt.models.glm5_next_nextn.Glm5NextForConditionalGenerationNextN",
)
TARGET_MODELS = (
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM",
    "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
    "sglang.srt.models.deepseek_v2.DeepseekV32ForCausalLM",
    "sglang.srt.models.glm4_moe.GlmMoeDsaForCausalLM",
)


def instance_attribute_stored(owner: type, name: str) -> bool:
    """Whether ``owner.__init__`` (or a base's) stores ``self.<name>``."""
    for cls in owner.__mro__:
        code = getattr(vars(cls).get("__init__"), "__code__", None)
        if code is not None and name in code.co_names:
            return True
    return False


def resolve(path: str):
    """The SGLang object at the dotted ``path``, resolved as ``HookRegistry`` resolves a target."""
    owner_path, _, attr = path.rpartition(".")
    return getattr(pkgutil.resolve_name(owner_path), attr)


def resolves(name: Name) -> bool:
    """Whether the installed SGLang has ``name``."""
    owner_path, _, attr = name.path.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError):
        return False
    if name.instance:
        return isinstance(owner, type) and instance_attribute_stored(owner, attr)
    if name.keywords:
        return keyword_only(getattr(owner, attr, None)) == name.keywords
    return hasattr(owner, attr)


def keyword_only(function) -> tuple[str, ...] | None:
    """The names of ``function``'s keyword-only parameters, in order (None: not a function)."""
    try:
        parameters = inspect.signature(inspect.unwrap(function)).parameters.values()
    except (TypeError, ValueError):
        return None
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def missing(switch: KillSwitch) -> list[str]:
    """The private names ``switch``'s feature needs that the installed SGLang lacks."""
    return [name.path for name in SURFACE if switch in name.switches and not resolves(name)]


# --- the accessors: the only code of the plugin that touches a private SGLang name -----------------


def patched_targets() -> set[str]:
    """The hook targets SGLang's ``HookRegistry`` has patched (it logs and skips one that fails)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return set(getattr(HookRegistry, "_patched", ()))


def graph_page_table_width(backend, metadata) -> int:
    """The page-table width a DSA backend's CUDA-graph replay passes its metadata kernel."""
    return backend._graph_page_table_width(metadata)


def to_2d_context_lens(cache_seqlens, bs: int):
    """SGLang's ``(bs, 1)`` view of a decode step's context lengths, as its indexer reads them."""
    from sglang.srt.layers.attention import dsa_backend

    return dsa_backend._to_2d_context_lens(cache_seqlens, bs)


def refresh_indexer_plans(backend, metadata, ctx_lens_2d) -> None:
    """What SGLang's decode replay refreshes for a step's indexer: the DeepGEMM paged-MQA schedule
    and the top-k v2 plan, from ``ctx_lens_2d``."""
    backend._refresh_paged_mqa_schedule_metadata(metadata, ctx_lens_2d)
    backend._refresh_topk_v2_plan(metadata)


def flashmla_metadata(backend, cache_seqlens, seq_len_q: int):
    """FlashMLA's tile-scheduler metadata for ``cache_seqlens`` (a new tensor)."""
    return backend._compute_flashmla_metadata(cache_seqlens=cache_seqlens, seq_len_q=seq_len_q)


def load_metadata_copies(multi_step: bool, has_real_page_table: bool, has_flashmla: bool) -> None:
    """Load (the first load compiles) SGLang's JIT metadata-copy modules of its MTP precompute +
    copies: the one-step copy, and with ``multi_step`` the three-step copy, at its decode cache keys.
    """
    from sglang.kernels.ops.attention.dsa import fused_metadata_copy as copies

    if multi_step:
        copies._jit_fused_metadata_copy_multi_module(has_real_page_table, has_flashmla)
    copies._jit_fused_metadata_copy_module(0, has_real_page_table, has_flashmla)


# SGLang's chunked-logits closure, as ``deepgemm_paged_mqa_logits_split`` receives it, and the
# global it resolves its chunk schedule with.
CHUNKED_LOGITS_CLOSURE = "Indexer._get_topk_paged.<locals>._chunked_fp8_paged_mqa_logits"
CHUNK_SCHEDULE_RESOLVER = "resolve_paged_mqa_logits_metadata_fn"


def compute_lm_head(processor, hidden_states, lm_head):
    """The processor's LM-head logits of ``hidden_states`` (this rank's vocab shard), by SGLang's
    own branch for the head (a plain matmul where the exchange engages)."""
    return processor._compute_lm_head(hidden_states, lm_head, None)


def gather_logits(processor, shard_rows):
    """The processor's all-gather of its vocab-shard logits rows over the TP ranks."""
    return processor._logits_gatherer(shard_rows)


def copy_logits_to_buffer(processor, logits, metadata):
    """The processor's cast of full logits into ``metadata``'s fp32 logits buffer, as its
    ``_get_logits`` ends a call without softcapping."""
    return processor._copy_logits_to_buffer(logits, metadata)


def custom_all_reduce_v2_takes(ca, nbytes: int) -> bool | None:
    """Whether SGLang's custom all-reduce v2 ``ca`` takes an all-reduce of ``nbytes`` inside a
    graph capture (its config picker with its graph mode); None for the legacy custom all-reduce,
    which has no picker."""
    if not hasattr(ca, "_pick_config"):
        return None
    return ca._pick_config(nbytes, bool(ca._is_graph_mode_supported)) is not None


def flashinfer_all_reduce_takes(group, probe) -> bool:
    """Whether ``group``'s FlashInfer all-reduce takes ``probe`` (its workspace, its size)."""
    return group._can_use_flashinfer_allreduce(probe)


def outplace_all_reduce_method(group_view, probe, *, should_use_pymscclpp_allreduce: bool):
    """The out-of-place all-reduce method SGLang's ``GroupCoordinator`` picks for ``probe``, asked
    on ``group_view`` (the communicators it reads), or None (in place)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator._resolve_outplace_all_reduce_method(
        group_view, probe, should_use_pymscclpp_allreduce=should_use_pymscclpp_allreduce
    )


def early_verify_metadata(runner):
    """The decode runner's early-staged verify metadata (DSpark), or None."""
    return runner._early_verify_metadata


def runner_glue_route(runner) -> tuple:
    """The decode runner's own glue route: (the ``MetadataGlueGraph`` it replays, or None; whether
    a glued replay skips the replay view)."""
    return runner._metadata_glue, runner._skip_glued_replay_view


def set_runner_glue_route(runner, glue, skip_view: bool) -> None:
    """Point the decode runner's own glue route at ``glue`` (a ``MetadataGlueGraph``, or None: no
    route): from its next replay on, its replay prep replays each key ``glue`` has captured for an
    unpadded batch itself (``MetadataGlueGraph.replay``; with ``skip_view``, without building the
    replay view first), and calls its prep through the replay view for every other replay."""
    runner._metadata_glue = glue
    runner._skip_glued_replay_view = skip_view


def glue_capture(graph, key) -> tuple | None:
    """What SGLang's ``MetadataGlueGraph`` ``graph`` captured for ``key``: (the ``CUDAGraph``, the
    snapshot of ``(backend, forward_metadata)`` pairs it reinstalls at each replay), or None."""
    st = graph._states.get(key)
    if st is None or st["graph"] is None:
        return None
    return st["graph"], st["meta"]


def breakable_decode_graphs() -> bool:
    """Whether the server's decode-phase graphs (every decode, target-verify and draft runner's)
    use SGLang's breakable backend, whose replays run attention eagerly between graph pieces."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    config = get_exec().graph.cuda_graph_config
    return config is not None and config.decode.backend == Backend.BREAKABLE


def dflash_family_speculation() -> bool:
    """Whether the server runs DFlash-family speculative decoding, whose verify plans are fed from
    the host (SGLang's decode runner keeps its own glue off for it)."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm).is_dflash_family()


def lora_enabled() -> bool:
    """Whether the server serves LoRA adapters (on the target model; the draft runs unadapted)."""
    from sglang.srt.runtime_context import get_lora

    return bool(get_lora().enable_lora)


def backend_per_batch_part() -> str | None:
    """The server option under which a runner's replays use a backend per micro-batch or stream
    (two-batch overlap, pdmux), in words; None without either."""
    from sglang.srt.runtime_context import get_disagg, get_exec

    if get_exec().overlap.enable_two_batch_overlap:
        return "two-batch overlap is on (a backend per micro-batch)"
    if get_disagg().enable_pdmux:
        return "pdmux is on (a backend per stream)"
    return None


def replay_glue_key(runner, bs: int, forward_mode, attention_variant) -> tuple:
    """The key the decode runner glues a replay of ``forward_mode`` at the captured ``bs`` under,
    as its ``load_batch`` computes it."""
    return runner._glue_key(bs, str(forward_mode), attention_variant)
