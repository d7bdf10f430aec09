"""``python -m sglang_dsa_mtp``: a readable report of this machine, and a non-zero exit on a failed check."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.plugins", reason="needs SGLang with its dependencies installed")

from sglang_dsa_mtp import selfcheck
from sglang_dsa_mtp.__main__ import main
from sglang_dsa_mtp.devices import cuda_blocker
from sglang_dsa_mtp.selfcheck import SelfCheck
from sglang_dsa_mtp.switches import SWITCHES
from sglang_dsa_mtp.test.check import CheckResult


def run_main(**env):
    """Run the command as a user would, without the TRITON_INTERPRET this test session set."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "sglang_dsa_mtp"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_reports_sglang_the_loader_the_switches_and_the_features():
    done = run_main()
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "SGLang         0.5.23 (tested)" in out
    assert "plugin loader  yes: loads entry point 'dsa_mtp'" in out
    for switch in SWITCHES:
        assert f"{switch.env}" in out and switch.feature in out
    if cuda_blocker():
        assert cuda_blocker() in out, "each feature says why it would not engage here"


def test_the_command_shows_a_switched_off_feature():
    done = run_main(SGLANG_DSA_BOUNDED_REPLAY_METADATA="0")
    assert done.returncode == 0, done.stderr
    [switch_line] = [
        line for line in done.stdout.splitlines() if "SGLANG_DSA_BOUNDED_REPLAY_METADATA  " in line
    ]
    assert switch_line.split()[1] == "off"


def test_with_no_checks_the_command_says_so_and_passes(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    assert main() == 0
    assert "none yet" in capsys.readouterr().out


def test_checks_are_tabled_with_their_timings(monkeypatch, capsys):
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        (SelfCheck("kernel-a", lambda device: CheckResult(True, "identical", 1.25, 7.5)),),
    )
    assert main() == 0
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if "kernel-a" in line]
    assert row == ["kernel-a", "ok", "1.2", "7.5", "identical"]


def test_a_failed_check_makes_the_exit_status_non_zero(monkeypatch, capsys):
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        (
            SelfCheck("kernel-a", lambda device: CheckResult(True, "identical")),
            SelfCheck("kernel-b", lambda device: CheckResult(False, "differs in 3 elements")),
        ),
    )
    assert main() == 1
    assert "FAIL" in capsys.readouterr().out


def live_width_rows(out: str) -> dict[str, str]:
    start = out.index("live_width part")
    rows = {}
    for line in out[start:].splitlines()[1:]:
        if not line.strip():
            break
        change, _, rest = line.strip().partition("  ")
        rows[change] = " ".join(rest.split())
    return rows


def test_the_command_says_what_the_live_width_switch_engages(monkeypatch, capsys, set_platform):
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    set_platform(cuda=True, hip=False)
    monkeypatch.setenv("SGLANG_OPT_USE_TOPK_V2", "0")
    monkeypatch.setenv("SGLANG_DSA_BOUNDED_REPLAY_METADATA", "0")
    assert main() == 0
    rows = live_width_rows(capsys.readouterr().out)
    assert rows["verify tree mask QLEN_ONLY, not read (DSA target)"].startswith("yes")
    assert rows["no wide page_table_1: target, draft extend"] == "no SGLANG_OPT_USE_TOPK_V2=0"
    assert rows["no wide page_table_1: MTP draft steps"] == (
        "no SGLANG_OPT_USE_TOPK_V2=0; SGLANG_DSA_BOUNDED_REPLAY_METADATA=0"
    )
    assert rows["one real_page_table per backend"].startswith("yes")


def test_the_live_width_parts_are_not_listed_when_the_switch_is_off(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    monkeypatch.setenv("SGLANG_DSA_LIVE_WIDTH", "0")
    assert main() == 0
    assert "live_width part" not in capsys.readouterr().out
