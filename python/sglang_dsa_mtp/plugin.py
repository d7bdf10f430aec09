"""SGLang plugin entry point: registers each enabled feature's hooks from one table.

SGLang's ``load_plugins()`` calls ``register()`` in every server process (entry point ``dsa_mtp`` in
the group ``sglang.srt.plugins``), then applies the registered hooks. A feature is registered whole or
not at all: it stays off, and SGLang keeps its own path, when the installed SGLang is not a version we
tested, when its kill switch is off, or when any of its hook rows does not resolve. ``register()``
never raises into SGLang.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import NamedTuple

from sglang.srt.environ import envs
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_dsa_mtp.integration.log import logger
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, SWITCHES, KillSwitch

ENTRY_POINT = "dsa_mtp"
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


_DSA_MANAGER = "sglang.srt.layers.attention.dsa.dsa_metadata_manager.DSAMetadataManagementMixin"
_DSA_MULTI_STEP = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"

# Every effect this plugin has on SGLang: (switch, SGLang target, hook type, our hook).
HOOKS: tuple[PluginHook, ...] = (
    # Bounded DSA replay-metadata kernels, once SGLang has picked its own (CUDA, kpool 1, no fusion).
    PluginHook(
        BOUNDED_REPLAY_METADATA,
        f"{_DSA_MANAGER}._init_kpool_metadata_fusion",
        HookType.AFTER,
        "sglang_dsa_mtp.integration.dsa_metadata_selection:select_bounded_metadata_kernels",
    ),
    # One-launch MTP draft-decode metadata: keep the seed flag, then replay per captured bs.
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
)


class FeatureStatus(NamedTuple):
    enabled: bool
    reason: str


@dataclass(frozen=True)
class _Plan:
    status: dict[str, FeatureStatus]
    hooks: tuple[tuple[PluginHook, Callable], ...]
    warnings: tuple[str, ...]


# What register() decided; None until it ran in this process.
_status: dict[str, FeatureStatus] | None = None


def sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None when it is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


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


class _Unresolved(LookupError):
    pass


def _resolve_rows(switch: KillSwitch) -> list[tuple[PluginHook, Callable]]:
    """Every row of ``switch``'s feature with its hook; raises naming the first that does not resolve."""
    resolved = []
    for row in HOOKS:
        if row.switch != switch:
            continue
        try:
            _resolve_target(row.target)
            resolved.append((row, _resolve_hook(row.hook)))
        except Exception as exc:
            raise _Unresolved(
                f"hook {row.hook} on {row.target} does not resolve ({type(exc).__name__}: {exc})"
            ) from exc
    return resolved


def _plan() -> _Plan:
    """What ``register()`` would register now, and why each feature is on or off."""
    version = sglang_version()
    if version not in TESTED_SGLANG_VERSIONS:
        installed = f"SGLang {version} is installed" if version else "SGLang is not installed"
        reason = f"{installed}; this plugin is tested with {', '.join(TESTED_SGLANG_VERSIONS)}"
        return _Plan(
            status={switch.feature: FeatureStatus(False, reason) for switch in SWITCHES},
            hooks=(),
            warnings=(f"all features are off, SGLang runs unchanged: {reason}",),
        )
    status, hooks, warnings = {}, [], []
    for switch in SWITCHES:
        enabled, why = switch.state()
        if not enabled:
            status[switch.feature] = FeatureStatus(False, why)
            continue
        try:
            rows = _resolve_rows(switch)
        except _Unresolved as exc:
            status[switch.feature] = FeatureStatus(False, str(exc))
            warnings.append(f"{switch.feature} is off, SGLang's own path is used: {exc}")
            continue
        if not rows:
            status[switch.feature] = FeatureStatus(False, "not yet implemented in this version")
            continue
        status[switch.feature] = FeatureStatus(True, why)
        hooks += rows
    return _Plan(status, tuple(hooks), tuple(warnings))


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
