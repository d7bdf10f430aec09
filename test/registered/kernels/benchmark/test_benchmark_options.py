"""Every kernel benchmark's command line: help text and the default for every option, a pointer to
what "the spec" is, and ``--help`` that exits 0 without a GPU."""

from pathlib import Path

import pytest

from support.scripts import has_default, load_script, options_help

SCRIPTS = sorted(Path(__file__).parent.rglob("bench_*.py"))


@pytest.fixture(params=SCRIPTS, ids=[path.name for path in SCRIPTS])
def script(request):
    return load_script(request.param)


@pytest.mark.quick
def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 3


def test_every_option_has_help_and_shows_its_default(script):
    for action, shown in options_help(script.build_parser()):
        assert action.help, f"{action.option_strings} has no help text"
        if has_default(action):
            assert f"(default: {action.default})" in shown, (action.option_strings, shown)


def test_help_exits_0_and_says_what_the_spec_is(script, capsys):
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    assert "docs/spec.md" in out
