"""SGLang plugin entry point: registers each enabled feature's rows of the tables in ``hooks``.

SGLang's ``load_plugins()`` calls ``register()`` in every server process (entry point ``dsa_mtp`` in
the group ``sglang.srt.plugins``), then applies the registered hooks. A feature is registered whole
or not at all: it stays off, and SGLang keeps its own path, when the installed SGLang is not a
version we tested, when its kill switch is off, when any of its rows does not resolve (a hook
target that is missing, an attribute SGLang already defines), or when SGLang lacks a private name it
reads (``sglang_surface``). ``register()`` never raises into SGLang.
Its one start-up line at INFO gives each feature's decision and, with the bounded replay metadata
on, how its replays launch (``launch.launch_path``).
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
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_dsa_mtp import hooks, sglang_surface
from sglang_dsa_mtp.hooks import PluginAttribute, PluginHook
from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.log import logger
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, SWITCHES, KillSwitch

ENTRY_POINT = "dsa_mtp"
# Accepted with any local build label too (PEP 440: ``0.5.23+cu130`` is a build of ``0.5.23``).
TESTED_SGLANG_VERSIONS = ("0.5.23",)


class FeatureStatus(NamedTuple):
    enabled: bool
    reason: str


@dataclass(frozen=True)
class _Plan:
    status: dict[str, FeatureStatus]
    hooks: tuple[tuple[PluginHook, Callable], ...]  # each row once, also when two features share it
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
    """Every hook and attribute row of ``switch``'s feature, resolved, and the private SGLang names
    it reads probed (``sglang_surface.missing``); raises naming the first row that does not
    resolve, or every name SGLang lacks."""
    resolved, attributes = [], []
    for row in hooks.rows_of(switch):
        try:
            _resolve_target(row.target)
            resolved.append((row, _resolve_hook(row.hook)))
        except Exception as exc:
            raise _Unresolved(
                f"hook {row.hook} on {row.target} does not resolve ({type(exc).__name__}: {exc})"
            ) from exc
    for row in hooks.attributes_of(switch):
        try:
            attributes.append((row, *_resolve_attribute(row)))
        except Exception as exc:
            raise _Unresolved(
                f"attribute {row.target} cannot be added ({type(exc).__name__}: {exc})"
            ) from exc
    lacking = sglang_surface.missing(switch)
    if lacking:
        raise _Unresolved(f"SGLang lacks {', '.join(lacking)}, which it reads")
    return resolved, attributes


def _plan(resolve: bool = True) -> _Plan:
    """What ``register()`` would register now, and why each feature is on or off. ``resolve=False``
    leaves out what importing the hook targets decides (it registers nothing: status only)."""
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
    status, registered, attributes, warnings = {}, [], [], []
    for switch in SWITCHES:
        enabled, why = switch.state()
        if not enabled:
            status[switch.feature] = FeatureStatus(False, why)
            continue
        if not hooks.rows_of(switch):
            status[switch.feature] = FeatureStatus(False, "not yet implemented in this version")
            continue
        status[switch.feature] = FeatureStatus(True, why)
        if not resolve:
            continue
        try:
            feature_hooks, feature_attributes = _resolve_rows(switch)
        except _Unresolved as exc:
            status[switch.feature] = FeatureStatus(False, str(exc))
            warnings.append(f"{switch.feature} is off, SGLang's own path is used: {exc}")
            continue
        registered += [pair for pair in feature_hooks if pair[0] not in dict(registered)]
        attributes += feature_attributes
    return _Plan(status, tuple(registered), tuple(attributes), tuple(warnings))


def feature_status(resolve: bool = True) -> dict[str, FeatureStatus]:
    """Per feature, whether it is on and why: as ``register()`` decided, or would decide now
    (``resolve=False``: without importing the hook targets)."""
    return dict(_status) if _status is not None else _plan(resolve).status


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
    logger.info("sglang_dsa_mtp: %s", "; ".join(_start_up_decisions(_status)))


def _start_up_decisions(status: dict[str, FeatureStatus]) -> list[str]:
    """The parts of ``register()``'s start-up line: each feature on or off and why, then, when the
    bounded replay metadata is on, how its replays launch."""
    decisions = [
        f"{feature} {'on' if s.enabled else 'off'} ({s.reason})" for feature, s in status.items()
    ]
    if status[BOUNDED_REPLAY_METADATA.feature].enabled:
        decisions.append(f"launches: {launch.launch_path()}")
    return decisions
