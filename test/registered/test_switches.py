"""Kill switches: their defaults (on, the metadata glue opt-in), SGLang's EnvBool words, and an unparsable value turns the feature off."""

import logging

import pytest

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp import devices
from sglang_dsa_mtp.switches import (
    ACCEPTED,
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    METADATA_GLUE,
    SWITCHES,
    VERIFY_ARGMAX_EXCHANGE,
)

SWITCH_PARAMS = [pytest.param(switch, id=switch.feature) for switch in SWITCHES]


def test_the_two_spec_switches_and_the_three_beyond_it():
    assert BOUNDED_REPLAY_METADATA.env == "SGLANG_DSA_BOUNDED_REPLAY_METADATA"
    assert DRAFT_ARGMAX_EXCHANGE.env == "SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE"
    assert VERIFY_ARGMAX_EXCHANGE.env == "SGLANG_SPEC_VERIFY_ARGMAX_EXCHANGE"
    assert LIVE_WIDTH.env == "SGLANG_DSA_LIVE_WIDTH"
    assert METADATA_GLUE.env == "SGLANG_DSA_METADATA_GLUE"
    assert SWITCHES == (
        BOUNDED_REPLAY_METADATA,
        DRAFT_ARGMAX_EXCHANGE,
        VERIFY_ARGMAX_EXCHANGE,
        LIVE_WIDTH,
        METADATA_GLUE,
    )


@pytest.mark.parametrize("switch", SWITCH_PARAMS)
def test_the_gate_asks_the_switch_first_then_the_platform(switch, fresh_switches, monkeypatch):
    monkeypatch.setattr(devices, "cuda_blocker", lambda: "not a CUDA platform (test)")
    monkeypatch.setenv(switch.env, "1")
    assert switch.blocker() == "not a CUDA platform (test)"
    monkeypatch.setenv(switch.env, "0")
    assert switch.blocker() == f"{switch.env}=0"
    monkeypatch.setattr(devices, "cuda_blocker", lambda: None)
    monkeypatch.setenv(switch.env, "1")
    assert switch.blocker() is None


@pytest.mark.parametrize("switch", SWITCH_PARAMS)
def test_an_unset_switch_takes_its_default(switch, fresh_switches):
    if switch.default:
        assert switch.state() == (True, "default on")
    else:
        assert switch.state() == (False, f"default off ({switch.env}=1 turns it on)")


def test_only_the_metadata_glue_is_opt_in():
    assert [switch for switch in SWITCHES if not switch.default] == [METADATA_GLUE]


@pytest.mark.parametrize("switch", SWITCH_PARAMS)
@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "n"])
def test_a_false_word_turns_the_switch_off(switch, value, fresh_switches, monkeypatch):
    monkeypatch.setenv(switch.env, value)
    assert switch.state() == (False, f"{switch.env}={value}")
    assert not switch.enabled()


@pytest.mark.parametrize("switch", SWITCH_PARAMS)
@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "y"])
def test_a_true_word_keeps_the_switch_on(switch, value, fresh_switches, monkeypatch):
    monkeypatch.setenv(switch.env, value)
    assert switch.state() == (True, f"{switch.env}={value}")
    assert switch.enabled()


@pytest.mark.quick
@pytest.mark.parametrize("switch", SWITCH_PARAMS)
@pytest.mark.parametrize("value", ["off", "2", "", " 1"])
def test_an_unparsable_value_turns_the_switch_off_and_logs_an_error_naming_the_variable(
    switch, value, fresh_switches, monkeypatch, caplog
):
    monkeypatch.setenv(switch.env, value)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        enabled, why = switch.state()
        switch.state()
    assert not enabled
    assert why == f"{switch.env} is invalid (see the error)"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, "the error is logged once per process, not on every read"
    assert switch.env in errors[0].getMessage() and ACCEPTED in errors[0].getMessage()


def test_each_switch_reads_only_its_own_variable(fresh_switches, monkeypatch):
    monkeypatch.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    assert not BOUNDED_REPLAY_METADATA.enabled()
    assert DRAFT_ARGMAX_EXCHANGE.enabled()
