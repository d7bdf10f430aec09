"""The package runs no code it generates: no ``exec``, ``eval`` or ``compile`` anywhere in it (the
names, called or passed around, and any ``.exec``, ``.eval`` or ``.compile`` attribute)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sglang_dsa_mtp"
FORBIDDEN = ("exec", "eval", "compile")


def generated_code(source: str, filename: str) -> list[str]:
    """Where ``source`` names one of :data:`FORBIDDEN`, as ``file:line: name``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        if name in FORBIDDEN:
            found.append(f"{filename}:{node.lineno}: {name}")
    return found


@pytest.mark.quick
def test_no_module_of_the_package_runs_generated_code():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, f"the package was not found at {PACKAGE}"
    found = [hit for path in files for hit in generated_code(path.read_text(), str(path))]
    assert found == []


@pytest.mark.quick
@pytest.mark.parametrize(
    "planted",
    [
        "exec(compile(source, '<planned>', 'exec'), namespace)",
        "key = eval(source)",
        "run = builtins.exec",
        "pattern = re.compile('x')",
    ],
)
def test_the_scan_finds_a_planted_one(planted):
    assert generated_code(f"x = 1\n{planted}\n", "planted.py") != []
