"""The end-to-end kit's commands (``benchmark/e2e/*.py``): help text for every option, the defaults
benchmark/README.md states, and a pointer to what "the spec" is."""

from pathlib import Path

import pytest

from support.sglang_import import require_sglang

require_sglang()

from support.scripts import has_default, load_script, options_help

KIT = Path(__file__).parents[3] / "benchmark" / "e2e"
SCRIPTS = sorted(KIT.glob("*.py"))


@pytest.fixture(params=SCRIPTS, ids=[path.name for path in SCRIPTS])
def script(request):
    return load_script(request.param)


@pytest.mark.quick
def test_the_kit_has_its_three_commands():
    assert [path.name for path in SCRIPTS] == ["gsm8k.py", "serve.py", "sweep.py"]


def test_every_option_has_help_and_shows_its_default(script):
    for action, shown in options_help(script.build_parser()):
        assert action.help, f"{action.option_strings} has no help text"
        if has_default(action):
            assert f"(default: {action.default})" in shown, (action.option_strings, shown)


@pytest.mark.parametrize(
    "name, option, default",
    [
        ("gsm8k.py", "--startup-timeout", "3600"),
        ("gsm8k.py", "--parallel", "128"),
        ("sweep.py", "--startup-timeout", "3600"),
        ("sweep.py", "--concurrency", "the preset's"),
    ],
)
def test_help_shows_the_defaults_the_readme_states(name, option, default, capsys):
    with pytest.raises(SystemExit) as done:
        load_script(KIT / name).main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert option in out and f"(default: {default})" in out
    assert "docs/spec.md" in out
