"""``python -m sglang_dsa_mtp``: a readable report of this machine, a real command line, and a
non-zero exit on an invalid kill-switch value or a failed check."""

import inspect
import logging
import os
import pkgutil
import subprocess
import sys
import warnings

import pytest

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp import hooks, selfcheck
from sglang_dsa_mtp.__main__ import (
    SGLANG_IMPORT_LOG_LINES,
    SGLANG_IMPORT_WARNINGS,
    main,
    quiet_sglang_import,
)
from sglang_dsa_mtp.devices import cuda_blocker
from sglang_dsa_mtp.selfcheck import CheckResult, SelfCheck
from sglang_dsa_mtp.switches import ACCEPTED, SWITCHES


def run_main(*args, python=(), merged=False, **env):
    """Run the command as a user would, without the TRITON_INTERPRET this test session set;
    ``python``: interpreter options; ``merged``: stderr into stdout, each write in the order it is
    made (unbuffered, as on a terminal)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env, **({"PYTHONUNBUFFERED": "1"} if merged else {}))
    return subprocess.run(
        [sys.executable, *python, "-m", "sglang_dsa_mtp", *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=300,
    )


def imported_modules(*args) -> set[str]:
    """The modules the command imports with ``args`` (``python -X importtime``)."""
    done = run_main(*args, python=("-X", "importtime"))
    assert done.returncode == 0, done.stderr
    return {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }


def record_checks(monkeypatch, *results):
    """Replace the self-checks by checks returning ``results``; the list of devices they ran on."""
    ran = []

    def check(result):
        def run(device):
            ran.append(device)
            return result

        return run

    checks = tuple(SelfCheck(f"kernel-{i}", check(r)) for i, r in enumerate(results))
    monkeypatch.setattr(selfcheck, "CHECKS", checks)
    return ran


def test_the_command_reports_sglang_the_loader_the_switches_and_the_features():
    done = run_main("--no-checks")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "SGLang         0.5.23 (tested)" in out
    assert "plugin loader  yes: loads entry point 'dsa_mtp'" in out
    for switch in SWITCHES:
        assert f"{switch.env}" in out and switch.feature in out
    if cuda_blocker():
        assert cuda_blocker() in out, "each feature says why it would not engage here"
    assert "live_width engages where the DSA indexer's logits have more rows than" in out


def test_the_screen_shows_no_sglang_import_warnings():
    """SGLang's warnings about a machine without CUDA are not about this plugin."""
    done = run_main("--no-checks")
    assert done.returncode == 0, done.stderr
    known = [start for _, start in SGLANG_IMPORT_WARNINGS + SGLANG_IMPORT_LOG_LINES]
    for line in done.stderr.splitlines():
        assert not any(start in line for start in known), line
        assert "/sglang/" not in line, f"a warning from SGLang's files: {line}"


def test_the_command_shows_a_switched_off_feature():
    done = run_main("--no-checks", SGLANG_DSA_BOUNDED_REPLAY_METADATA="0")
    assert done.returncode == 0, done.stderr
    [switch_line] = [
        line for line in done.stdout.splitlines() if "SGLANG_DSA_BOUNDED_REPLAY_METADATA  " in line
    ]
    assert switch_line.split()[1] == "off"


@pytest.mark.quick
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_neither_sglang_nor_torch(flag):
    """They answer at once: SGLang's import alone takes seconds."""
    modules = imported_modules(flag)
    assert "sglang_dsa_mtp.log" in modules, "the command's own imports are seen"
    assert {name.partition(".")[0] for name in modules} & {"sglang", "torch", "triton"} == set()


def test_no_checks_imports_no_module_of_a_hook_target():
    """Importing the targets is most of the time the full status takes; --no-checks leaves it to the
    server (and says so)."""
    targets = set()
    for row in (*hooks.HOOKS, *hooks.ATTRIBUTES):
        owner = pkgutil.resolve_name(row.target.rpartition(".")[0])
        targets.add(owner.__name__ if inspect.ismodule(owner) else owner.__module__)
    modules = imported_modules("--no-checks")
    assert "sglang.srt.plugins" in modules, "the command's imports are seen"
    assert targets & modules == set()


def test_help_shows_the_usage_and_exits_0(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m sglang_dsa_mtp")
    assert "--no-checks" in out and "Exit status" in out


def test_an_unknown_flag_is_rejected_with_exit_2(monkeypatch, capsys):
    ran = record_checks(monkeypatch, CheckResult(True, "identical"))
    with pytest.raises(SystemExit) as done:
        main(["--bogus"])
    assert done.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert ran == []


def test_no_checks_prints_the_status_and_runs_no_check(monkeypatch, capsys):
    ran = record_checks(monkeypatch, CheckResult(False, "would fail"))
    assert main(["--no-checks"]) == 0
    assert ran == []
    out = capsys.readouterr().out
    assert "kill switch" in out and "feature" in out
    assert "skipped (--no-checks)" in out


def test_without_flags_every_check_runs(monkeypatch, capsys):
    ran = record_checks(monkeypatch, CheckResult(True, "a"), CheckResult(True, "b"))
    assert main() == 0
    assert len(ran) == 2


def test_the_checks_end_with_a_summary_line(monkeypatch, capsys):
    record_checks(monkeypatch, CheckResult(True, "a"), CheckResult(False, "b"))
    assert main() == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "1/2 self-checks bit-identical to SGLang's code" in out


def test_on_the_cpu_untimed_checks_say_why_and_cuda_checks_are_named_not_run(monkeypatch, capsys):
    """No empty timing columns: the table has none, and the summary says why; a check that needs
    CUDA is not run on the CPU, and the summary names it."""
    ran = []
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        (
            SelfCheck("kernel-a", lambda device: ran.append("a") or CheckResult(True, "same")),
            SelfCheck(
                "kernel-b",
                lambda device: ran.append("b") or CheckResult(True, "same"),
                needs_cuda=True,
            ),
        ),
    )
    assert main() == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())
    assert ran == ["a"]
    [header] = [line for line in out.splitlines() if line.strip().startswith("self-check ")]
    assert header.split() == ["self-check", "result"]
    assert "1/1 self-checks bit-identical to SGLang's code (untimed: Triton's interpreter" in words
    assert "not run here, they need a CUDA GPU" in words and words.endswith("kernel-b")


def test_with_no_checks_registered_the_command_says_so_and_passes(monkeypatch, capsys):
    record_checks(monkeypatch)
    assert main() == 0
    assert "none yet" in capsys.readouterr().out


@pytest.mark.quick
@pytest.mark.parametrize("no_checks", [True, False], ids=["no-checks", "with-checks"])
def test_an_invalid_switch_value_exits_1_naming_the_variable(
    no_checks, fresh_switches, monkeypatch, capsys
):
    record_checks(monkeypatch, CheckResult(True, "identical"))
    monkeypatch.setenv("SGLANG_DSA_LIVE_WIDTH", "maybe")
    assert main(["--no-checks"] if no_checks else []) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ERROR sglang_dsa_mtp: SGLANG_DSA_LIVE_WIDTH='maybe' is not a boolean")
    assert err[-1] == (
        "python -m sglang_dsa_mtp: error: "
        "SGLANG_DSA_LIVE_WIDTH='maybe' is not a boolean (see above)"
    ), "the last line says why the exit status is 1"
    assert [line for line in err if "maybe" in line] == [err[0], err[-1]]


def test_the_last_line_names_every_reason_for_the_exit_status(fresh_switches, monkeypatch, capsys):
    """An invalid value, the loader leaving the plugin out and a failed check: the output ends on
    one line naming all three, not on the checks' summary."""
    record_checks(monkeypatch, CheckResult(True, "identical"), CheckResult(False, "differs"))
    monkeypatch.setenv("SGLANG_DSA_LIVE_WIDTH", "maybe")
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    assert main() == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m sglang_dsa_mtp: error: SGLANG_DSA_LIVE_WIDTH='maybe' is not a boolean (see "
        "above); SGLang's plugin loader does not load this plugin (see 'plugin loader'); "
        "self-check 'kernel-1' failed"
    )


def test_an_invalid_switch_value_is_one_message_first_in_the_output():
    """The whole output, as on a terminal: the server's error, once, before anything else, every
    line within 100 columns; the switch and the feature rows point to it, and the last line names
    it again as the reason for the exit status."""
    done = run_main("--no-checks", merged=True, SGLANG_DSA_LIVE_WIDTH="maybe")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    words = " ".join(done.stdout.split())
    assert lines[0].startswith(
        "ERROR sglang_dsa_mtp: SGLANG_DSA_LIVE_WIDTH='maybe' is not a boolean"
    )
    assert lines[-1] == (
        "python -m sglang_dsa_mtp: error: "
        "SGLANG_DSA_LIVE_WIDTH='maybe' is not a boolean (see above)"
    )
    assert words.count("'maybe'") == 2 and words.count(ACCEPTED) == 1
    assert words.count("is not a boolean") == 2 and words.count("ERROR") == 1
    assert words.count("SGLANG_DSA_LIVE_WIDTH is invalid (see the error)") == 2
    assert "live_width stays off" in words and words.count("error:") == 1
    assert_fits(done.stdout)


def test_log_lines_on_the_screen_carry_one_prefix(fresh_switches, monkeypatch, capsys):
    """The messages name the plugin themselves (SGLang's server log prints no logger names); the
    screen adds the level, not the logger name again."""
    monkeypatch.setenv("SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE", "off")
    main(["--no-checks"])
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ERROR")]
    assert line.startswith("ERROR sglang_dsa_mtp: SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE='off'")
    assert "sglang_dsa_mtp:sglang_dsa_mtp" not in line
    assert logging.getLogger("sglang_dsa_mtp").handlers == [], "the screen handler is removed"


def test_quiet_sglang_import_drops_only_the_known_warnings(caplog):
    [(arch_logger, arch_line)] = SGLANG_IMPORT_LOG_LINES
    with warnings.catch_warnings(record=True) as shown, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with quiet_sglang_import():
            for category, start in SGLANG_IMPORT_WARNINGS:
                warnings.warn(start + " (details)", category)
            warnings.warn("Only CUDA supports something new.", UserWarning)
            warnings.warn("MultiPlatformOp is fine", UserWarning)
            logging.getLogger(arch_logger).warning(arch_line)
            logging.getLogger(arch_logger).warning("Another arch problem.")
        logging.getLogger(arch_logger).warning(arch_line)
    assert [str(w.message) for w in shown] == [
        "Only CUDA supports something new.",
        "MultiPlatformOp is fine",
    ]
    assert [r.getMessage() for r in caplog.records] == ["Another arch problem.", arch_line]


def test_checks_are_tabled_with_their_timings(monkeypatch, capsys):
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        (SelfCheck("kernel-a", lambda device: CheckResult(True, "identical", 1.25, 7.5)),),
    )
    assert main() == 0
    out = capsys.readouterr().out.splitlines()
    [at] = [i for i, line in enumerate(out) if "kernel-a" in line]
    assert out[at].split() == ["kernel-a", "ok", "1.2", "7.5"]
    assert out[at + 1] == "    identical", "the detail below its row"


def test_a_failed_check_makes_the_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        (
            SelfCheck("kernel-a", lambda device: CheckResult(True, "identical")),
            SelfCheck("kernel-b", lambda device: CheckResult(False, "differs in 3 elements")),
        ),
    )
    assert main() == 1
    done = capsys.readouterr()
    assert "FAIL" in done.out
    assert (
        done.err.splitlines()[-1] == "python -m sglang_dsa_mtp: error: self-check 'kernel-b' failed"
    )


@pytest.mark.parametrize(
    "version, note", [("0.5.23+cu130", "0.5.23+cu130 (tested)"), ("0.6.0", "0.6.0 (NOT tested")]
)
def test_the_command_names_a_local_build_of_the_tested_version_tested(
    version, note, monkeypatch, capsys
):
    from sglang_dsa_mtp import plugin

    monkeypatch.setattr(plugin, "sglang_version", lambda: version)
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    assert main() == 0
    out = capsys.readouterr().out.splitlines()
    [line] = [line for line in out if line.strip().startswith("SGLang ")]
    assert note in line


def live_width_rows(out: str) -> dict[str, str]:
    """The live_width table's rows, each part's wrapped cell joined again."""
    start = out.index("live_width part")
    rows, change = {}, None
    for line in out[start:].splitlines()[1:]:
        if not line.strip():
            break
        if line.startswith("   "):  # the last cell continued under its start
            rows[change] += " " + line.strip()
            continue
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
    assert rows["verify mask QLEN_ONLY, not read (target)"].startswith("yes")
    assert rows["no wide page_table_1: target, draft extend"] == "no SGLANG_OPT_USE_TOPK_V2=0"
    assert rows["no wide page_table_1: MTP draft steps"] == (
        "no SGLANG_OPT_USE_TOPK_V2=0; SGLANG_DSA_BOUNDED_REPLAY_METADATA=0"
    )
    assert rows["one real_page_table per backend"].startswith("yes")


def test_the_command_exits_1_when_sglangs_loader_leaves_the_plugin_out():
    done = run_main("--no-checks", SGLANG_PLUGINS="some_other_plugin")
    assert done.returncode == 1
    assert "plugin loader  NO: entry point 'dsa_mtp' found but not loaded" in done.stdout
    assert done.stderr.splitlines()[-1] == (
        "python -m sglang_dsa_mtp: error: SGLang's plugin loader does not load this plugin "
        "(see 'plugin loader')"
    )


def test_an_invalid_live_width_value_keeps_its_table_with_the_reason(
    fresh_switches, monkeypatch, capsys
):
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    monkeypatch.setenv("SGLANG_DSA_LIVE_WIDTH", "maybe")
    assert main() == 1
    rows = live_width_rows(capsys.readouterr().out)
    assert len(rows) == 4
    assert all(row.startswith("no its switch's value is invalid") for row in rows.values())


def test_the_live_width_parts_are_not_listed_when_the_switch_is_off(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "CHECKS", ())
    monkeypatch.setenv("SGLANG_DSA_LIVE_WIDTH", "0")
    assert main() == 0
    assert "live_width part" not in capsys.readouterr().out


# --- the screen: every line of the status and the self-checks fits 100 columns -------------------

LONG_DETAIL = (
    "decode + verify + draft extend, bs 16, width 1048640, random lengths: bit-identical (times: "
    "the three ops together), and a token longer than a line: " + "x" * 120
)


def assert_fits(out: str) -> None:
    wide = [(len(line), line) for line in out.splitlines() if len(line) > 100]
    assert wide == [], f"{len(wide)} lines wider than 100 columns, the widest {max(wide)[0]}"


@pytest.mark.parametrize(
    "platform, env",
    [
        ("cpu", {}),
        ("cuda", {}),
        ("cuda", {"SGLANG_OPT_USE_TOPK_V2": "0", "SGLANG_DSA_BOUNDED_REPLAY_METADATA": "no"}),
        ("cuda", {"SGLANG_DSA_LIVE_WIDTH": "maybe", "SGLANG_PLUGINS": "some_other_plugin"}),
    ],
    ids=["cpu", "cuda", "cuda-top-k-v1-bounded-off", "cuda-invalid-switch-plugin-left-out"],
)
def test_every_status_line_fits_100_columns(
    platform, env, fresh_switches, monkeypatch, capsys, set_platform, triton_release
):
    """The longest texts the status prints: a CUDA platform's live_width conditions, the
    launches, an invalid switch value, SGLang's loader leaving the plugin out."""
    triton_release("3.9.0")
    set_platform(cuda=platform == "cuda", hip=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    main(["--no-checks"])
    out = capsys.readouterr().out
    assert "launches" in out and "kill switch" in out
    assert_fits(out)


def test_an_untested_sglang_fits_100_columns(monkeypatch, capsys):
    from sglang_dsa_mtp import plugin

    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.6.0.dev20261201+cu130")
    main(["--no-checks"])
    out = capsys.readouterr().out
    assert "NOT tested" in out
    assert_fits(out)


def test_every_self_check_line_fits_100_columns(monkeypatch, capsys):
    """The shipped checks' names, with GPU-length details and timings."""
    monkeypatch.setattr(
        selfcheck,
        "CHECKS",
        tuple(
            SelfCheck(check.name, lambda device: CheckResult(True, LONG_DETAIL, 123.25, 1585.75))
            for check in selfcheck.CHECKS
        ),
    )
    assert main() == 0
    out = capsys.readouterr().out
    assert_fits(out)
    start = out.index("self-check ")
    table = out[start:].splitlines()
    assert table[1].split() == [selfcheck.CHECKS[0].name.split()[0], *table[1].split()[1:]]
    assert table[1].split()[-3:] == ["ok", "123.2", "1585.8"]
    detail = []
    for line in table[2:]:
        if not line.startswith("    "):
            break
        detail.append(line.strip())
    assert " ".join(detail).replace("x ", "x") == LONG_DETAIL, "the detail, wrapped below its row"
