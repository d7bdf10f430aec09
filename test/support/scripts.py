"""The repository's command-line scripts (benchmarks, the end-to-end kit), loaded by path for their
tests, and each option's help as ``--help`` shows it."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """Execute the script at ``path`` as a module (its ``__main__`` block does not run)."""
    name = f"_script_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def options_help(parser: argparse.ArgumentParser) -> list[tuple[argparse.Action, str]]:
    """Every option but ``--help`` and ``--version``, with its help text expanded as ``--help``
    prints it (``%(default)s`` filled in, and whatever the parser's formatter adds)."""
    formatter = parser._get_formatter()
    return [
        (action, formatter._expand_help(action) if action.help else "")
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
    ]


def has_default(action: argparse.Action) -> bool:
    """Whether ``action`` has a default worth showing: not a flag, not None, not an empty list."""
    default = action.default
    return not (default is None or default is False or default == [] or action.required)
