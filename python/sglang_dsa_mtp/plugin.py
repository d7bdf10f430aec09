"""SGLang plugin entry point: registers each enabled feature's hooks from two tables.

SGLang's ``load_plugins()`` calls ``register()`` in every server process (entry point ``dsa_mtp`` in
the group ``sglang.srt.plugins``), then applies the registered hooks. ``HOOKS`` lists every hook on an
SGLang function or method; ``ATTRIBUTES`` lists the few names the plugin adds to SGLang classes (an
opt-in method, a field default), which SGLang's ``HookRegistry`` cannot create. A feature is registered
whole or not at all: it stays off, and SGLang keeps its own path, when the installed SGLang is not a
version we tested, when its kill switch is off, or when any of its rows does not resolve (a hook
target that is missing, an attribute SGLang already defines). ``register()`` never raises into SGLang.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import NamedTuple

from packaging.version import InvalidVersion, Version
from sglang.srt.environ import envs
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_dsa_mtp.integration.log import logger
from sglang_dsa_mtp.switches import (
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    SWITCHES,
    KillSwitch,
)

ENTRY_POINT = "dsa_mtp"
# Accepted with any local build label too (PEP 440: ``0.5.23+cu130`` is a build of ``0.5.23``).
TESTED_SGLANG_VERSIONS = ("0.5.23",)


@dataclass(frozen=True)
class PluginHook:
    """One row of the hook table: while ``switch`` is on, ``hook`` is registered on ``target``.

    ``target`` is the dotted path of the SGLang function, method or class, resolved as SGLang's
    ``HookRegistry`` does. ``hook`` is ``"sglang_dsa_mtp.integration.<module>:<function>"``, imported
    only by ``register()``, so importing this module never imports kernel code.
    """

    switch: KillSwitch
    target: str
    hook_type: HookType
    hook: str


@dataclass(frozen=True)
class PluginAttribute:
    """One row of the attribute table: while ``switch`` is on, ``target`` is set to ``value``.

    ``target`` is ``"<dotted SGLang class>.<new attribute>"``; the class must not define the attribute
    already (if it does, SGLang has changed and the feature stays off). ``value`` is
    ``"sglang_dsa_mtp.integration.<module>:<name>"``, imported only by ``register()``. With
    ``shadows`` (a dotted SGLang base class), the class must instead inherit the attribute from that
    base, and the row gives the class its own definition in front of the inherited one.
    """

    switch: KillSwitch
    target: str
    value: str
    shadows: str | None = None


_DSA_MANAGER = "sglang.srt.layers.attention.dsa.dsa_metadata_manager.DSAMetadataManagementMixin"
_DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_DSA_MULTI_STEP = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"
_LOGITS = "sglang.srt.layers.logits_processor"
_EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_DRAFT_EXTEND_RUNNER = (
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner"
)
_DSA_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
_PAGED_MQA_LOGITS = "sglang.kernels.ops.attention.dsa.paged_mqa_logits"
_EXCHANGE = "sglang_dsa_mtp.integration.draft_argmax_exchange"
_EAGLE_PICK = "sglang_dsa_mtp.integration.eagle_draft_argmax"
_LIVE_LOGITS = "sglang_dsa_mtp.integration.dsa_indexer_live_logits"
_DSA = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_VERIFY_MASK = "sglang_dsa_mtp.integration.dsa_verify_mask"
_PAGE_TABLES = "sglang_dsa_mtp.integration.dsa_graph_page_tables"

# Every effect this plugin has on SGLang: (switch, SGLang target, hook type, our hook).
HOOKS: tuple[PluginHook, ...] = (
    # Bounded DSA replay-metadata kernels, once SGLang has picked its own (CUDA, kpool 1, no fusion),
    # each with SGLang's kernel as its per-bs fallback.
    PluginHook(
        BOUNDED_REPLAY_METADATA,
        f"{_DSA_MANAGER}._init_kpool_metadata_fusion",
        HookType.AFTER,
        "sglang_dsa_mtp.integration.dsa_metadata_selection:select_bounded_metadata_kernels",
    ),
    # At capture, as each bs's graph metadata is built: compile the kernel its replays will launch.
    PluginHook(
        BOUNDED_REPLAY_METADATA,
        f"{_DSA_BACKEND}._build_forward_metadata_cuda_graph",
        HookType.AFTER,
        "sglang_dsa_mtp.integration.dsa_metadata_capture:warm_up_captured_bs",
    ),
    # One-launch MTP draft-decode metadata: keep the seed flag, then capture (deciding and warming
    # up per bs) and replay.
    PluginHook(
        BOUNDED_REPLAY_METADATA,
        f"{_DSA_MULTI_STEP}.__init__",
        HookType.AROUND,
        "sglang_dsa_mtp.integration.dsa_mtp_draft_metadata:keep_seed_flag",
    ),
    PluginHook(
        BOUNDED_REPLAY_METADATA,
        f"{_DSA_MULTI_STEP}.init_forward_metadata_out_graph",
        HookType.AROUND,
        "sglang_dsa_mtp.integration.dsa_mtp_draft_metadata:one_launch_out_graph",
    ),
    # Greedy-draft argmax exchange, in an opted-in draft LogitsProcessor: all-reduce the shard's
    # argmax partials instead of gathering the logits, and hand the partials on with the output.
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessor._get_logits",
        HookType.AROUND,
        f"{_EXCHANGE}:exchange_instead_of_gather",
    ),
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessor.forward",
        HookType.AFTER,
        f"{_EXCHANGE}:attach_partials",
    ),
    # The EAGLE v2 draft worker opts its draft model in before capturing its graphs, then picks
    # its greedy tokens from the partials: draft decode inside the graph (draft_topk1_postprocess's
    # rule), draft extend right after its replay (torch.argmax's rule).
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_EAGLE_V2}._capture_cuda_graphs",
        HookType.BEFORE,
        f"{_EAGLE_PICK}:opt_in_draft_model",
    ),
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        "sglang.kernels.ops.speculative.topk1.draft_topk1_postprocess",
        HookType.AROUND,
        f"{_EAGLE_PICK}:draft_decode_pick",
    ),
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_DRAFT_EXTEND_RUNNER}.execute",
        HookType.AROUND,
        f"{_EAGLE_PICK}:draft_extend_replay_pick",
    ),
    PluginHook(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_EAGLE_V2}._draft_extend_for_decode",
        HookType.AROUND,
        f"{_EAGLE_PICK}:draft_extend_for_decode",
    ),
    # Live width: indexer logits of more rows than SMs are joined live columns only, not by a
    # full-width concat; the copy kernel is compiled when the indexer is built.
    PluginHook(
        LIVE_WIDTH,
        f"{_PAGED_MQA_LOGITS}.deepgemm_paged_mqa_logits_split",
        HookType.AROUND,
        f"{_LIVE_LOGITS}:live_width_split",
    ),
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA_INDEXER}.__init__",
        HookType.AFTER,
        f"{_LIVE_LOGITS}:warm_up_live_logits",
    ),
    # Live width, CUDA graph state: the DSA target gets a QLEN_ONLY, not-read verify mask (no
    # bs x context FULL_MASK per round); no wide page_table_1 where nothing reads it (SGLang's own
    # drop, its spec clause lifted; step backends only when the one launch owns their replay, with
    # a per-step replay as fallback); else one real_page_table buffer per backend, sliced per bs.
    # (init_graph_state wraps SGLang's method directly: the first row on a target is innermost.)
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA}.init_cuda_graph_state",
        HookType.AROUND,
        f"{_PAGE_TABLES}:init_graph_state",
    ),
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA}.init_cuda_graph_state",
        HookType.AFTER,
        f"{_VERIFY_MASK}:create_verify_mask",
    ),
    PluginHook(LIVE_WIDTH, f"{_DSA}.__init__", HookType.AFTER, f"{_VERIFY_MASK}:remember_runner"),
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA}._init_kpool_metadata_capture",
        HookType.BEFORE,
        f"{_PAGE_TABLES}:capture_into_shared_real_table",
    ),
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA_MULTI_STEP}.init_cuda_graph_state",
        HookType.AROUND,
        f"{_PAGE_TABLES}:steps_graph_state",
    ),
    PluginHook(
        LIVE_WIDTH,
        f"{_DSA_MULTI_STEP}.init_forward_metadata_out_graph",
        HookType.AROUND,
        f"{_PAGE_TABLES}:replay_steps_without_wide_table",
    ),
)

# Names the plugin adds to SGLang classes: (switch, SGLang class + new attribute, our value).
ATTRIBUTES: tuple[PluginAttribute, ...] = (
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessor.enable_draft_argmax_exchange",
        f"{_EXCHANGE}:enable_draft_argmax_exchange",
    ),
    PluginAttribute(
        DRAFT_ARGMAX_EXCHANGE,
        f"{_LOGITS}.LogitsProcessorOutput.next_token_argmax_partials",
        f"{_EXCHANGE}:NO_PARTIALS",
    ),
    # Live width: the DSA backend's own verify_mask property, in front of AttentionBackend's (None).
    PluginAttribute(
        LIVE_WIDTH,
        f"{_DSA}.verify_mask",
        f"{_VERIFY_MASK}:verify_mask",
        shadows="sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
    ),
)


class FeatureStatus(NamedTuple):
    enabled: bool
    reason: str


@dataclass(frozen=True)
class _Plan:
    status: dict[str, FeatureStatus]
    hooks: tuple[tuple[PluginHook, Callable], ...]
    attributes: tuple[tuple[PluginAttribute, type, object], ...]
    warnings: tuple[str, ...]


# What register() decided; None until it ran in this process.
_status: dict[str, FeatureStatus] | None = None


def sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None when it is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def version_tested(version: str | None) -> bool:
    """Whether ``version`` is a tested SGLang release, or a local build of one (``0.5.23+cu130``).

    Pre-, post- and dev releases and other versions are not; nor is an unparsable version."""
    if version is None:
        return False
    try:
        public = Version(version).public
    except InvalidVersion:
        return False
    return public in TESTED_SGLANG_VERSIONS


def discovery() -> tuple[bool, str]:
    """Whether SGLang's plugin loader would run ``register()`` in this environment, and why (not)."""
    if ENTRY_POINT in load_plugins_by_group(GENERAL_PLUGINS_GROUP):
        return True, f"loads entry point {ENTRY_POINT!r} ({GENERAL_PLUGINS_GROUP})"
    if not any(ep.name == ENTRY_POINT for ep in metadata.entry_points(group=GENERAL_PLUGINS_GROUP)):
        return (
            False,
            f"no entry point {ENTRY_POINT!r} in {GENERAL_PLUGINS_GROUP}: pip install this package",
        )
    return False, (
        f"entry point {ENTRY_POINT!r} found but not loaded: SGLANG_PLUGINS="
        f"{envs.SGLANG_PLUGINS.get()!r} leaves it out, or importing it failed"
    )


def _resolve_target(target: str) -> object:
    """Resolve ``target`` the way ``HookRegistry`` will: the owner by ``pkgutil``, then ``getattr``."""
    owner, _, attr = target.rpartition(".")
    if not owner:
        raise ValueError(f"{target!r} is not a dotted path to an attribute")
    return getattr(pkgutil.resolve_name(owner), attr)


def _resolve_hook(path: str) -> Callable:
    hook = pkgutil.resolve_name(path)
    if not callable(hook):
        raise TypeError(f"{path} is not callable")
    return hook


def _resolve_attribute(row: PluginAttribute) -> tuple[type, object]:
    """The SGLang class that gets ``row``'s new attribute, and the value it gets."""
    owner_path, _, name = row.target.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    if not isinstance(owner, type):
        raise TypeError(f"{owner_path} is not a class")
    if row.shadows is None:
        if hasattr(owner, name):
            raise AttributeError(f"SGLang already defines {name}; this plugin does not replace it")
    else:
        defined_by = next((cls for cls in owner.__mro__ if name in vars(cls)), None)
        if defined_by is not pkgutil.resolve_name(row.shadows):
            where = "nowhere" if defined_by is None else f"in {defined_by.__qualname__}"
            raise AttributeError(
                f"{name} is defined {where}, not only in {row.shadows}; this plugin does not "
                "replace it"
            )
    return owner, pkgutil.resolve_name(row.value)


class _Unresolved(LookupError):
    pass


def _resolve_rows(switch: KillSwitch) -> tuple[list, list]:
    """Every hook and attribute row of ``switch``'s feature, resolved; raises naming the first that
    does not resolve."""
    hooks, attributes = [], []
    for row in HOOKS:
        if row.switch != switch:
            continue
        try:
            _resolve_target(row.target)
            hooks.append((row, _resolve_hook(row.hook)))
        except Exception as exc:
            raise _Unresolved(
                f"hook {row.hook} on {row.target} does not resolve ({type(exc).__name__}: {exc})"
            ) from exc
    for row in ATTRIBUTES:
        if row.switch != switch:
            continue
        try:
            attributes.append((row, *_resolve_attribute(row)))
        except Exception as exc:
            raise _Unresolved(
                f"attribute {row.target} cannot be added ({type(exc).__name__}: {exc})"
            ) from exc
    return hooks, attributes


def _plan() -> _Plan:
    """What ``register()`` would register now, and why each feature is on or off."""
    version = sglang_version()
    if not version_tested(version):
        installed = f"SGLang {version} is installed" if version else "SGLang is not installed"
        reason = (
            f"{installed}; this plugin is tested with {', '.join(TESTED_SGLANG_VERSIONS)} "
            f"(local builds such as {TESTED_SGLANG_VERSIONS[-1]}+cu130 included)"
        )
        return _Plan(
            status={switch.feature: FeatureStatus(False, reason) for switch in SWITCHES},
            hooks=(),
            attributes=(),
            warnings=(f"all features are off, SGLang runs unchanged: {reason}",),
        )
    status, hooks, attributes, warnings = {}, [], [], []
    for switch in SWITCHES:
        enabled, why = switch.state()
        if not enabled:
            status[switch.feature] = FeatureStatus(False, why)
            continue
        try:
            feature_hooks, feature_attributes = _resolve_rows(switch)
        except _Unresolved as exc:
            status[switch.feature] = FeatureStatus(False, str(exc))
            warnings.append(f"{switch.feature} is off, SGLang's own path is used: {exc}")
            continue
        if not feature_hooks:
            status[switch.feature] = FeatureStatus(False, "not yet implemented in this version")
            continue
        status[switch.feature] = FeatureStatus(True, why)
        hooks += feature_hooks
        attributes += feature_attributes
    return _Plan(status, tuple(hooks), tuple(attributes), tuple(warnings))


def feature_status() -> dict[str, FeatureStatus]:
    """Per feature, whether it is on and why: as ``register()`` decided, or would decide now."""
    return dict(_status) if _status is not None else _plan().status


def register() -> None:
    """Called by SGLang's ``load_plugins()``; idempotent, and never raises."""
    global _status
    if _status is not None:
        return
    try:
        plan = _plan()
        for warning in plan.warnings:
            logger.warning("sglang_dsa_mtp: %s", warning)
        for row, owner, value in plan.attributes:
            setattr(owner, row.target.rpartition(".")[2], value)
        for row, hook in plan.hooks:
            HookRegistry.register(row.target, hook, row.hook_type)
        _status = plan.status
    except Exception:
        logger.exception(
            "sglang_dsa_mtp: registration failed; SGLang runs without this plugin's changes"
        )
        _status = {
            switch.feature: FeatureStatus(False, "registration failed") for switch in SWITCHES
        }
    logger.info(
        "sglang_dsa_mtp: %s",
        "; ".join(
            f"{feature} {'on' if s.enabled else 'off'} ({s.reason})"
            for feature, s in _status.items()
        ),
    )
