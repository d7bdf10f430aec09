"""``require_sglang()``: a test module that needs SGLang skips only where SGLang is not installed."""

import ast
import sys
from importlib import metadata
from pathlib import Path

import pytest

from support import sglang_import
from support.sglang_import import (
    NOT_INSTALLED,
    modules_requiring_sglang,
    require_sglang,
)

TESTS = Path(__file__).resolve().parents[1]


def not_installed(name):
    raise metadata.PackageNotFoundError(name)


def test_without_the_sglang_distribution_the_module_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(pytest.skip.Exception, match="sglang distribution is not"):
        require_sglang()
    assert sglang_import.sglang_version() is None


def test_an_installed_sglang_that_does_not_import_is_an_error_not_a_skip(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.23")
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", None)  # as a broken dependency would
    with pytest.raises(ImportError, match=r"sglang 0\.5\.23 is installed but .* failed"):
        try:
            require_sglang()
        except pytest.skip.Exception as skip:
            pytest.fail(f"skipped instead of failing: {skip}")


@pytest.mark.quick
def test_an_installed_sglang_that_imports_passes():
    if sglang_import.sglang_version() is None:
        pytest.skip(NOT_INSTALLED)
    assert require_sglang() is None
    assert "sglang.srt.plugins" in sys.modules


def module_imports_sglang_before_requiring_it(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if getattr(node.value.func, "id", None) == "require_sglang":
                return False
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        if any(name == "sglang" or name.startswith("sglang.") for name in names):
            return True
    return False


def test_every_test_module_requires_sglang_before_importing_it():
    modules = sorted(p for p in TESTS.rglob("*.py") if p != Path(__file__).resolve())
    assert len(modules) > 30
    offenders = [
        str(p.relative_to(TESTS)) for p in modules if module_imports_sglang_before_requiring_it(p)
    ]
    assert offenders == []
    skipping = [
        str(p.relative_to(TESTS)) for p in modules if 'importorskip("sglang' in p.read_text()
    ]
    assert skipping == [], "pytest.importorskip turns a broken SGLang install into skips"


def test_the_modules_requiring_sglang_are_those_that_call_it(tmp_path):
    (tmp_path / "test_top.py").write_text("from x import require_sglang\n\nrequire_sglang()\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_inside.py").write_text("def test_a():\n    require_sglang()\n")
    (tmp_path / "sub" / "test_plain.py").write_text("# require_sglang() in a comment\n")
    (tmp_path / "sub" / "conftest.py").write_text("require_sglang()\n")
    assert modules_requiring_sglang([tmp_path]) == [
        tmp_path / "sub" / "test_inside.py",
        tmp_path / "test_top.py",
    ]
    assert modules_requiring_sglang([tmp_path / "sub" / "test_plain.py"]) == []


def test_the_repository_modules_requiring_sglang_include_the_hook_site_tests():
    modules = {str(p.relative_to(TESTS)) for p in modules_requiring_sglang([TESTS])}
    assert "integration/test_dsa_indexer_live_logits.py" in modules
    assert "unit/spec/test_draft_argmax_exchange_sglang_tp.py" in modules
    assert "kernels/ops/attention/test_dsa_metadata_bounded.py" not in modules


def test_a_test_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such"):
        modules_requiring_sglang([tmp_path / "no-such"])
