"""Every message the plugin logs starts with ``sglang_dsa_mtp:``: SGLang's server log format
(``[time TP0] message``) prints no logger name, so the prefix is what finds our lines there."""

import ast
import logging
from pathlib import Path

import pytest

import sglang_dsa_mtp

PACKAGE = Path(sglang_dsa_mtp.__file__).parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def log_messages(path: Path) -> list[tuple[int, object]]:
    """(line, message) of each ``log_once(level, key, msg, ...)``, ``log_failure(key, exc, msg,
    ...)`` and ``logger.<level>(msg, ...)`` call in ``path``; the message is the literal string, or
    its AST node when it is not one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("log_once", "log_failure"):
            message = node.args[2]
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in LEVELS
            and isinstance(func.value, ast.Name)
            and func.value.id == "logger"
            and node.args
        ):
            message = node.args[0]
        else:
            continue
        literal = isinstance(message, ast.Constant) and isinstance(message.value, str)
        found.append((node.lineno, message.value if literal else message))
    return found


SOURCES = [
    path
    for path in sorted(PACKAGE.rglob("*.py"))
    # log.py holds the helpers, which pass their callers' messages on.
    if "testing" not in path.relative_to(PACKAGE).parts
    and path.name != "log.py"
    and log_messages(path)
]


def test_the_plugin_logs_from_several_files():
    names = {path.name for path in SOURCES}
    assert {"plugin.py", "switches.py", "fallback.py", "dsa_mtp_draft_metadata.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_log_message_starts_with_the_plugin_name(path):
    for line, message in log_messages(path):
        assert isinstance(message, str), f"{path.name}:{line}: the message is not a literal"
        assert message.startswith("sglang_dsa_mtp: "), f"{path.name}:{line}: {message!r}"


@pytest.mark.quick
def test_log_failure_logs_once_at_error_with_the_exception(caplog, monkeypatch):
    from sglang_dsa_mtp import log

    monkeypatch.setattr(log, "_seen", set())
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        for _ in range(2):
            log.log_failure(("k",), RuntimeError("boom"), "sglang_dsa_mtp: %s failed", "x")
    assert [r.getMessage() for r in caplog.records] == [
        "sglang_dsa_mtp: x failed: RuntimeError: boom"
    ]
