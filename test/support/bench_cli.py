"""Command-line helpers shared by the kernel benchmark scripts under ``test/registered/kernels/benchmark``.

The help layout (:class:`HelpFormatter`, :func:`benchmark_parser`), the timing options every
benchmark takes (:func:`add_timing_arguments`), the ``--tune NAME=v1,v2`` sweeps of our kernels'
tunables, comma-separated integer lists, the (live length, batch size, mixed) sweep points,
markdown table rows, and the JSON file of every measurement. The timing itself is in :mod:`support.timing`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Optional

# Module constants of dsa_metadata_bounded a sweep may override, plus the launch's ``budget``.
TUNABLE = ("TILE_N", "NUM_WARPS", "NUM_STAGES", "budget")
MIXED_SHORT = 1024  # the other requests' length in a mixed batch


SPEC_EPILOG = (
    "The spec: docs/spec.md, the upstream SGLang pull request this plugin re-creates, with its "
    "GB300 tables."
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks, and shows each option's default after its help (except
    for flags, options without a default, and help that states its default itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        no_default = default is None or default is False or default is argparse.SUPPRESS
        if "(default" in help_text or no_default or default == []:
            return help_text
        return f"{help_text} (default: %(default)s)"


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: the first two paragraphs of ``doc`` (what it measures, which of the
    spec's tables it reproduces) as the description, defaults shown, and what "the spec" is."""
    return argparse.ArgumentParser(
        description="\n\n".join(doc.split("\n\n")[:2]),
        epilog=SPEC_EPILOG,
        formatter_class=HelpFormatter,
    )


def parse_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def parse_tune(items) -> list[dict]:
    """``NAME=v1,v2`` items -> every combination, as {NAME: value} overrides of our defaults."""
    variants = [{}]
    for item in items:
        name, _, values = item.partition("=")
        if name not in TUNABLE or not values:
            raise SystemExit(f"--tune takes NAME=v1,v2,... with NAME in {TUNABLE}, got {item!r}")
        variants = [{**v, name: int(x)} for v in variants for x in values.split(",")]
    return variants


def variant_name(overrides: dict) -> str:
    """Column title: "ours" for the defaults, else the overridden tunables."""
    return " ".join(["ours", *(f"{k.lower()}={v}" for k, v in overrides.items())])


@contextlib.contextmanager
def tunables(module: ModuleType, overrides: Optional[dict] = None) -> Iterator[Optional[int]]:
    """Set ``overrides`` (but ``budget``) on ``module`` inside the block; yields the budget."""
    overrides = dict(overrides or {})
    budget = overrides.pop("budget", None)
    defaults = {name: getattr(module, name) for name in overrides}
    for name, value in overrides.items():
        setattr(module, name, value)
    try:
        yield budget
    finally:
        for name, value in defaults.items():
            setattr(module, name, value)


def add_mixed_argument(parser) -> None:
    """``--mixed``: see :func:`sweep_points`."""
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="also a mixed batch per (live, bs > 1): one request at the live length, the others "
        f"at {MIXED_SHORT} tokens",
    )


def sweep_points(firsts, lives, batch_sizes, mixed: bool) -> list[tuple]:
    """``(first, live, bs, is_mixed)`` for every combination, in that order, with a mixed point after
    each ``bs > 1`` one when ``mixed`` (``first``: the op or step count the benchmark sweeps)."""
    return [
        (first, live, bs, is_mixed)
        for first in firsts
        for live in lives
        for bs in batch_sizes
        for is_mixed in ((False, True) if mixed and bs > 1 else (False,))
    ]


def batch_lengths(live: int, bs: int, mixed: bool) -> list[int]:
    """Every request at ``live`` tokens, or (``mixed``) the first at ``live``, the rest at 1k."""
    return [live] + [MIXED_SHORT if mixed else live] * (bs - 1)


TIE_SHARE, TIE_US = 0.01, 0.1  # within 1% + 0.1 us of the fastest other arm counts as a tie


def fastest_verdict(ours: float, others: list) -> str:
    """Whether ``ours`` is the fastest among ``others`` (microseconds): ``yes`` (no slower than
    any), ``tie`` (slower by at most 1% + 0.1 us of the fastest) or ``**NO**``."""
    best = min(others)
    if ours <= best:
        return "yes"
    return "tie" if ours <= best * (1 + TIE_SHARE) + TIE_US else "**NO**"


def markdown_header(header: list[str]) -> str:
    return "| " + " | ".join(header) + " |\n" + "|" + "---|" * len(header)


def markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def measurements(
    *, gpu: str, launch_floor_us: float, copy_bytes_per_us: float, points: list, **settings
) -> dict:
    """Every measurement of a benchmark run, with the floors it was printed against and the
    settings it ran with: what ``--json`` writes."""
    return dict(
        gpu=gpu,
        launch_floor_us=launch_floor_us,
        copy_bytes_per_us=copy_bytes_per_us,
        **settings,
        points=points,
    )


def write_json(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def add_timing_arguments(parser) -> None:
    """The options every kernel benchmark takes: tunable sweeps, graph size, replays, cold or hot
    L2, and a JSON file for every measurement."""
    parser.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="NAME=v1,v2",
        help=f"sweep one of our tunables {TUNABLE} (repeatable: every combination is timed)",
    )
    parser.add_argument(
        "--calls", type=int, default=20, help="calls captured back to back in one CUDA graph"
    )
    parser.add_argument(
        "--replays", type=int, default=30, help="timed graph replays; each figure is their median"
    )
    parser.add_argument("--hot-l2", action="store_true", help="skip the cold-L2 memsets")
    parser.add_argument("--json", help="write every measurement to this file")
