"""The plugin entry point: SGLang's loader runs register(), which registers each enabled feature whole.

Rows of the hook table are swapped in per test; they hook ``EnvBool.parse``, a real SGLang method that
is cheap to call and to restore. Attribute rows add names to ``EnvBool``; every attribute a test adds
to an SGLang class is removed afterwards.
"""

import logging
import pkgutil

import pytest

from support.sglang_import import require_sglang

require_sglang()

import sglang.srt.plugins
from sglang.srt.environ import EnvBool
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_dsa_mtp import hooks, plugin
from sglang_dsa_mtp.hooks import PluginAttribute, PluginHook
from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.plugin import ENTRY_POINT, FeatureStatus
from sglang_dsa_mtp.switches import (
    ACCEPTED,
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    SWITCHES,
)

TARGET = "sglang.srt.environ.EnvBool.parse"
HOOK = f"{__name__}:record_parse"
NEW_ATTRIBUTE = "sglang.srt.environ.EnvBool.sglang_dsa_mtp_test_attribute"
ATTRIBUTE_VALUE = 42
parsed = []


def record_parse(result, self, value):
    """An AFTER hook on ``EnvBool.parse``: records what was parsed, keeps the result."""
    parsed.append((value, result))


def attribute_owner_and_name(row: PluginAttribute) -> tuple[type, str]:
    owner, _, name = row.target.rpartition(".")
    return pkgutil.resolve_name(owner), name


@pytest.fixture
def fresh_plugin(fresh_switches, monkeypatch):
    """A process where no plugin has loaded yet: empty hook registry, ``register()`` not yet run.

    Everything is restored afterwards, including ``EnvBool.parse`` should SGLang's loader patch it,
    and the attributes ``register()`` added to SGLang classes are removed.
    """
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(sglang.srt.plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugin, "_status", None)
    monkeypatch.setattr(EnvBool, "parse", EnvBool.parse)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    parsed.clear()
    rows = hooks.ATTRIBUTES + (PluginAttribute(BOUNDED_REPLAY_METADATA, NEW_ATTRIBUTE, ""),)
    absent = [
        (owner, name)
        for owner, name in map(attribute_owner_and_name, rows)
        if name not in vars(owner)
    ]
    yield monkeypatch
    for owner, name in absent:
        if name in vars(owner):
            delattr(owner, name)


def use_hooks(monkeypatch, *rows, attributes=()):
    monkeypatch.setattr(hooks, "HOOKS", rows)
    monkeypatch.setattr(hooks, "ATTRIBUTES", attributes)


def registered():
    return {
        target: [hook_type for hook_type, _, _ in hooks]
        for target, hooks in HookRegistry._hooks.items()
    }


def plugin_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "sglang_dsa_mtp" and r.levelno == logging.WARNING
    ]


def start_up_line(caplog) -> str:
    """register()'s one INFO line."""
    [info] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    return info


# --- discovery by SGLang's own loader --------------------------------------------------------------


def test_sglang_discovers_the_entry_point():
    assert plugin.discovery() == (True, f"loads entry point {ENTRY_POINT!r} (sglang.srt.plugins)")


@pytest.mark.quick
def test_sglang_load_plugins_runs_register_and_applies_its_hooks(fresh_plugin):
    # Whitelist only this plugin: others installed with SGLang (smg-grpc-servicer) would patch SGLang
    # for the rest of the session.
    fresh_plugin.setenv("SGLANG_PLUGINS", ENTRY_POINT)
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))

    sglang.srt.plugins.load_plugins()

    assert plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature] == (True, "default on")
    assert registered() == {TARGET: [HookType.AFTER]}
    assert EnvBool(True).parse("yes") is True
    assert parsed == [("yes", True)], "SGLang applied our hook to its method"


def test_the_sglang_plugins_whitelist_can_leave_the_plugin_out(fresh_plugin):
    fresh_plugin.setenv("SGLANG_PLUGINS", "some_other_plugin")
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))

    discovered, why = plugin.discovery()
    sglang.srt.plugins.load_plugins()

    assert not discovered and "SGLANG_PLUGINS='some_other_plugin'" in why
    assert plugin._status is None, "register() did not run"
    assert registered() == {}


# --- what register() registers ---------------------------------------------------------------------


def every_switch_on(monkeypatch) -> None:
    """The opt-in switches set on too: the server that runs every change."""
    for switch in SWITCHES:
        if not switch.default:
            monkeypatch.setenv(switch.env, "1")


def test_an_opt_in_feature_registers_nothing_by_default(fresh_plugin):
    plugin.register()
    opt_in = [switch for switch in SWITCHES if not switch.default]
    default_on = {row.target for s in SWITCHES if s.default for row in hooks.rows_of(s)}
    assert opt_in
    for switch in opt_in:
        own = {row.target for row in hooks.rows_of(switch)} - default_on
        assert own and not own & set(registered()), switch.feature
        assert plugin.feature_status()[switch.feature] == (
            False,
            f"default off ({switch.env}=1 turns it on)",
        )


def test_the_shipped_table_resolves_completely(fresh_plugin, caplog):
    every_switch_on(fresh_plugin)
    plugin.register()
    assert plugin_warnings(caplog) == []
    assert len(registered()) == len({row.target for row in hooks.HOOKS})
    for row in hooks.ATTRIBUTES:
        owner, name = attribute_owner_and_name(row)
        assert vars(owner)[name] is pkgutil.resolve_name(row.value)


def test_the_shipped_attributes_are_an_opt_in_method_and_a_none_field_default(fresh_plugin):
    from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput

    plugin.register()
    assert callable(LogitsProcessor.enable_draft_argmax_exchange)
    assert LogitsProcessorOutput(next_token_logits=None).next_token_argmax_partials is None


def test_the_dsa_backends_verify_mask_is_none_until_the_plugin_creates_one(fresh_plugin):
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    plugin.register()
    assert isinstance(vars(DeepseekSparseAttnBackend)["verify_mask"], property)
    assert object.__new__(DeepseekSparseAttnBackend).verify_mask is None


def use_one_hook_and_one_attribute(monkeypatch, target=NEW_ATTRIBUTE):
    use_hooks(
        monkeypatch,
        PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK),
        attributes=(
            PluginAttribute(BOUNDED_REPLAY_METADATA, target, f"{__name__}:ATTRIBUTE_VALUE"),
        ),
    )


def test_attribute_rows_are_added_with_their_feature(fresh_plugin):
    use_one_hook_and_one_attribute(fresh_plugin)
    plugin.register()
    assert EnvBool.sglang_dsa_mtp_test_attribute == ATTRIBUTE_VALUE


def test_attribute_rows_of_a_switched_off_feature_are_not_added(fresh_plugin):
    fresh_plugin.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    use_one_hook_and_one_attribute(fresh_plugin)
    plugin.register()
    assert not hasattr(EnvBool, "sglang_dsa_mtp_test_attribute")


def test_an_attribute_sglang_already_defines_disables_its_feature(fresh_plugin, caplog):
    use_one_hook_and_one_attribute(fresh_plugin, target="sglang.srt.environ.EnvBool.parse")
    with caplog.at_level(logging.WARNING, logger="sglang_dsa_mtp"):
        plugin.register()
    assert registered() == {}
    assert EnvBool.parse is not ATTRIBUTE_VALUE
    status = plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature]
    assert not status.enabled and "already defines parse" in status.reason
    [warning] = plugin_warnings(caplog)
    assert "EnvBool.parse" in warning


def use_one_shadowing_attribute(monkeypatch, target, shadows="sglang.srt.environ.EnvField"):
    use_hooks(
        monkeypatch,
        PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK),
        attributes=(
            PluginAttribute(
                BOUNDED_REPLAY_METADATA, target, f"{__name__}:ATTRIBUTE_VALUE", shadows=shadows
            ),
        ),
    )


def test_a_shadowing_attribute_goes_in_front_of_the_one_its_base_defines(fresh_plugin):
    use_one_shadowing_attribute(fresh_plugin, "sglang.srt.environ.EnvBool.is_set")
    try:
        plugin.register()
        assert vars(EnvBool)["is_set"] == ATTRIBUTE_VALUE
        assert plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature].enabled
    finally:
        if "is_set" in vars(EnvBool):
            delattr(EnvBool, "is_set")


@pytest.mark.parametrize(
    "target,shadows,defined",
    [
        ("sglang.srt.environ.EnvBool.parse", "sglang.srt.environ.EnvField", "in EnvBool"),
        ("sglang.srt.environ.EnvBool.is_set", "sglang.srt.environ.EnvBool", "in EnvField"),
        ("sglang.srt.environ.EnvBool.no_such_name", "sglang.srt.environ.EnvField", "nowhere"),
    ],
    ids=["the-class-defines-it", "another-base-defines-it", "nothing-defines-it"],
)
def test_a_shadowing_attribute_whose_definition_moved_disables_its_feature(
    fresh_plugin, target, shadows, defined
):
    use_one_shadowing_attribute(fresh_plugin, target, shadows)
    plugin.register()
    status = plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature]
    assert not status.enabled and f"is defined {defined}" in status.reason
    assert getattr(EnvBool, target.rpartition(".")[2], None) != ATTRIBUTE_VALUE


def test_a_feature_without_hook_rows_is_off_as_not_yet_implemented(fresh_plugin):
    every_switch_on(fresh_plugin)
    use_hooks(fresh_plugin)
    plugin.register()
    assert plugin.feature_status() == {
        switch.feature: (False, "not yet implemented in this version") for switch in SWITCHES
    }


def test_a_switched_off_feature_registers_nothing(fresh_plugin):
    fresh_plugin.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    plugin.register()
    assert registered() == {}
    assert plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature] == (
        False,
        "SGLANG_DSA_BOUNDED_REPLAY_METADATA=0",
    )


def test_an_unparsable_switch_registers_nothing_and_logs_one_error(fresh_plugin, caplog):
    fresh_plugin.setenv(DRAFT_ARGMAX_EXCHANGE.env, "off")
    use_hooks(fresh_plugin, PluginHook((DRAFT_ARGMAX_EXCHANGE,), TARGET, HookType.AFTER, HOOK))
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        plugin.register()
        status = plugin.feature_status()[DRAFT_ARGMAX_EXCHANGE.feature]
    assert registered() == {}
    assert status == (False, f"{DRAFT_ARGMAX_EXCHANGE.env} is invalid (see the error)")
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"{DRAFT_ARGMAX_EXCHANGE.env}='off' is not a boolean ({ACCEPTED})" in error


@pytest.mark.parametrize(
    "bad_row",
    [
        pytest.param(
            PluginHook(
                (BOUNDED_REPLAY_METADATA,),
                "sglang.srt.environ.EnvBool.no_such_method",
                HookType.AFTER,
                HOOK,
            ),
            id="missing-attribute",
        ),
        pytest.param(
            PluginHook(
                (BOUNDED_REPLAY_METADATA,), "sglang.srt.no_such_module.f", HookType.AFTER, HOOK
            ),
            id="missing-module",
        ),
        pytest.param(
            PluginHook(
                (BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, f"{__name__}:no_such_hook"
            ),
            id="missing-hook",
        ),
        pytest.param(
            PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, f"{__name__}:TARGET"),
            id="hook-not-callable",
        ),
    ],
)
def test_a_row_that_does_not_resolve_disables_only_its_feature(bad_row, fresh_plugin, caplog):
    good_row_same_feature = PluginHook(
        (BOUNDED_REPLAY_METADATA,), "sglang.srt.environ.EnvBool.__init__", HookType.AFTER, HOOK
    )
    other_feature_row = PluginHook((DRAFT_ARGMAX_EXCHANGE,), TARGET, HookType.AFTER, HOOK)
    use_hooks(fresh_plugin, good_row_same_feature, bad_row, other_feature_row)

    with caplog.at_level(logging.WARNING, logger="sglang_dsa_mtp"):
        plugin.register()

    assert registered() == {
        TARGET: [HookType.AFTER]
    }, "none of the broken feature's rows registered"
    status = plugin.feature_status()
    assert not status[BOUNDED_REPLAY_METADATA.feature].enabled
    assert bad_row.target in status[BOUNDED_REPLAY_METADATA.feature].reason
    assert status[DRAFT_ARGMAX_EXCHANGE.feature] == (True, "default on")
    [warning] = plugin_warnings(caplog)
    assert BOUNDED_REPLAY_METADATA.feature in warning and bad_row.target in warning


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23+cu130", "0.5.23+rocm7.1.local"])
def test_the_tested_version_and_its_local_builds_register_the_features(
    version, fresh_plugin, caplog
):
    fresh_plugin.setattr(plugin, "sglang_version", lambda: version)
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))

    with caplog.at_level(logging.WARNING, logger="sglang_dsa_mtp"):
        plugin.register()

    assert registered() == {TARGET: [HookType.AFTER]}
    assert plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature] == (True, "default on")
    assert plugin_warnings(caplog) == []


@pytest.mark.parametrize(
    "version",
    ["0.6.0", "0.5.22+cu130", "0.5.23.post1", "0.5.23rc1", "0.5.23.dev0", "0.5.230", "0.5.23+"],
)
def test_other_versions_are_not_tested_ones(version):
    assert plugin.version_tested(version) is False


def test_an_untested_sglang_version_turns_every_feature_off_with_one_warning(fresh_plugin, caplog):
    fresh_plugin.setattr(plugin, "sglang_version", lambda: "0.6.0")
    use_hooks(
        fresh_plugin,
        PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK),
        PluginHook(
            (DRAFT_ARGMAX_EXCHANGE,), "sglang.srt.environ.EnvBool.__init__", HookType.AFTER, HOOK
        ),
    )

    with caplog.at_level(logging.WARNING, logger="sglang_dsa_mtp"):
        plugin.register()

    assert registered() == {}
    [warning] = plugin_warnings(caplog)
    assert "SGLang 0.6.0 is installed; this plugin is tested with 0.5.23" in warning
    assert all(
        not s.enabled and "SGLang 0.6.0" in s.reason for s in plugin.feature_status().values()
    )


def test_register_twice_registers_once(fresh_plugin, caplog):
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        plugin.register()
        plugin.register()
    assert registered() == {TARGET: [HookType.AFTER]}
    assert (
        len([r for r in caplog.records if r.levelno == logging.INFO]) == 1
    ), "features are logged once"


def test_register_logs_which_features_are_on_at_info(fresh_plugin, caplog):
    fresh_plugin.setenv(DRAFT_ARGMAX_EXCHANGE.env, "0")
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        plugin.register()
    info = start_up_line(caplog)
    assert "bounded_replay_metadata on (default on)" in info
    assert "draft_argmax_exchange off (SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE=0)" in info


@pytest.mark.parametrize("release", ["3.6.0", "3.9.0"])
def test_the_start_up_line_says_how_the_replays_launch(
    release, fresh_plugin, caplog, triton_release
):
    triton_release(release)
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        plugin.register()
    line = start_up_line(caplog)
    assert f"launches: {launch.launch_path()}" in line and f"(Triton {release})" in line


def test_with_the_bounded_kernels_off_the_start_up_line_names_no_launch(
    fresh_plugin, caplog, triton_release
):
    triton_release("3.9.0")
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    fresh_plugin.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        plugin.register()
    assert "launches:" not in start_up_line(caplog)


def test_register_never_raises_into_sglang(fresh_plugin, caplog):
    def broken_plan():
        raise RuntimeError("boom")

    fresh_plugin.setattr(plugin, "_plan", broken_plan)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        plugin.register()
    assert any("boom" in r.exc_text for r in caplog.records if r.exc_text)
    assert plugin.feature_status() == {
        switch.feature: FeatureStatus(False, "registration failed") for switch in SWITCHES
    }


def test_feature_status_before_register_reports_without_registering(fresh_plugin):
    use_hooks(fresh_plugin, PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK))
    assert plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature] == (True, "default on")
    assert registered() == {}


def test_feature_status_without_resolving_leaves_out_only_what_the_targets_decide(fresh_plugin):
    missing = PluginHook((BOUNDED_REPLAY_METADATA,), f"{TARGET}_missing", HookType.AFTER, HOOK)
    use_hooks(fresh_plugin, missing, PluginHook((LIVE_WIDTH,), TARGET, HookType.AFTER, HOOK))
    fresh_plugin.setenv(LIVE_WIDTH.env, "0")
    unresolved = plugin.feature_status(resolve=False)
    assert unresolved[BOUNDED_REPLAY_METADATA.feature] == (True, "default on")
    assert unresolved[LIVE_WIDTH.feature] == (False, f"{LIVE_WIDTH.env}=0")
    assert unresolved[DRAFT_ARGMAX_EXCHANGE.feature] == (
        False,
        "not yet implemented in this version",
    )
    assert not plugin.feature_status()[BOUNDED_REPLAY_METADATA.feature].enabled
    assert registered() == {}


# --- one owner per SGLang target ---------------------------------------------------------------------


def test_the_shipped_table_has_one_hook_per_sglang_target():
    targets = [row.target for row in hooks.HOOKS]
    assert len(targets) == len(set(targets))


def test_sglang_applies_the_shipped_table_without_a_multiple_hooks_warning(
    fresh_plugin, sglang_targets_restored, caplog
):
    """SGLang's loader warns "Multiple AROUND hooks" when two hooks wrap one target."""
    fresh_plugin.setenv("SGLANG_PLUGINS", ENTRY_POINT)
    every_switch_on(fresh_plugin)
    with caplog.at_level(logging.DEBUG):
        sglang.srt.plugins.load_plugins()
    assert all(switch.enabled() for switch in SWITCHES)
    assert set(HookRegistry._patched) == {row.target for row in hooks.HOOKS}
    assert [r.getMessage() for r in caplog.records if "Multiple" in r.getMessage()] == []
    for switch in SWITCHES:
        assert hooks.unapplied_hooks(switch) == []


def test_a_row_two_features_share_is_registered_once_while_either_is_on(fresh_plugin):
    shared = PluginHook((BOUNDED_REPLAY_METADATA, LIVE_WIDTH), TARGET, HookType.AFTER, HOOK)
    use_hooks(fresh_plugin, shared)
    fresh_plugin.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    plugin.register()
    assert registered() == {TARGET: [HookType.AFTER]}
    status = plugin.feature_status()
    assert (
        status[LIVE_WIDTH.feature].enabled and not status[BOUNDED_REPLAY_METADATA.feature].enabled
    )


def test_a_row_two_features_share_is_registered_once_when_both_are_on(fresh_plugin):
    shared = PluginHook((BOUNDED_REPLAY_METADATA, LIVE_WIDTH), TARGET, HookType.AFTER, HOOK)
    use_hooks(fresh_plugin, shared)
    plugin.register()
    assert registered() == {TARGET: [HookType.AFTER]}


def test_unapplied_hooks_names_the_targets_sglang_did_not_patch(fresh_plugin):
    use_hooks(
        fresh_plugin,
        PluginHook((BOUNDED_REPLAY_METADATA,), TARGET, HookType.AFTER, HOOK),
        PluginHook(
            (BOUNDED_REPLAY_METADATA, LIVE_WIDTH),
            "sglang.srt.environ.EnvBool.__init__",
            HookType.AFTER,
            HOOK,
        ),
    )
    fresh_plugin.setattr(HookRegistry, "_patched", {TARGET})
    assert hooks.unapplied_hooks(BOUNDED_REPLAY_METADATA) == ["sglang.srt.environ.EnvBool.__init__"]
    assert hooks.unapplied_hooks(LIVE_WIDTH) == ["sglang.srt.environ.EnvBool.__init__"]
    assert hooks.unapplied_hooks(DRAFT_ARGMAX_EXCHANGE) == []
