"""``python -m sglang_dsa_mtp``: what the plugin would do on this machine, then the kernel self-checks.

Prints SGLang's version, whether SGLang's plugin loader picks this package up, which launch the
kernels' launch plans make under the installed Triton, the kill switches, whether each feature would
engage here and why not, from how many running requests the live-width indexer logits engage on
this GPU, and one row per kernel self-check (``--no-checks`` skips them). The exit status is 0 when SGLang's plugin loader loads this plugin,
every kill-switch value is valid and every self-check passes; 1 when the loader leaves the plugin
out, a value is invalid or a check fails; 2 on a bad command line. The rows come from
:mod:`sglang_dsa_mtp.status`, the checks from the test support (``sglang_dsa_mtp.testing``), which
only this command imports, and only when it runs them.

The tables go to stdout, every line at most :data:`WIDTH` columns: a table's last column wraps
under its own start, a self-check's detail goes on the lines below its row. This package's log
records go to stderr as ``LEVEL sglang_dsa_mtp: ...`` (each message carries its ``sglang_dsa_mtp:``
prefix, which is what names them in SGLang's server log, whose format has no logger names). SGLang's own import-time warnings about a machine without
CUDA (``SGLANG_IMPORT_WARNINGS``, ``SGLANG_IMPORT_LOG_LINES``) are not about this plugin and are
kept off this screen; any other warning is shown as usual.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import textwrap
import warnings
from collections.abc import Iterator, Sequence

import torch

import sglang_dsa_mtp
from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.log import logger

# SGLang's warnings while it is imported on a machine without CUDA: (category, start of message).
SGLANG_IMPORT_WARNINGS = (
    (UserWarning, "Only CUDA, HIP and XPU support AWQ currently."),
    (UserWarning, "Only CUDA, MUSA and NPU support GGUF quantization currently."),
    (UserWarning, "Triton is not supported on current platform, roll back to CPU."),
    (DeprecationWarning, "MultiPlatformOp is deprecated"),
)
# SGLang's log lines at the same moment: (logger name, start of message).
SGLANG_IMPORT_LOG_LINES = (("sglang.kernels.jit.utils.arch", "Cannot detect CUDA architecture."),)
WIDTH = 100  # columns of the printed status and self-checks
INDENT = "  "


@contextlib.contextmanager
def quiet_sglang_import() -> Iterator[None]:
    """Inside the block, SGLang's known import-time warnings and log lines (above) are dropped;
    every other warning and log record passes as usual."""
    filters = []
    for name, start in SGLANG_IMPORT_LOG_LINES:

        def keep(record: logging.LogRecord, start: str = start) -> bool:
            return not record.getMessage().startswith(start)

        logging.getLogger(name).addFilter(keep)
        filters.append((name, keep))
    try:
        with warnings.catch_warnings():
            for category, start in SGLANG_IMPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(start), category=category)
            yield
    finally:
        for name, keep in filters:
            logging.getLogger(name).removeFilter(keep)


@contextlib.contextmanager
def log_to_screen() -> Iterator[None]:
    """Inside the block, this package's records at INFO and above go to stderr as
    ``LEVEL sglang_dsa_mtp: ...``, and only there; the logger is restored afterwards."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dsa_mtp",
        description=(
            "What the sglang-dsa-mtp plugin would do on this machine (SGLang's version, the plugin "
            "loader, the launch plans, the kill switches, each feature and why it would not "
            "engage), then each of its kernels checked against SGLang's own, bit for bit: on a "
            "CUDA GPU, with timings; otherwise on the CPU through Triton's interpreter, at small "
            "sizes."
        ),
        epilog=(
            "Exit status: 0 when SGLang's plugin loader loads the plugin, every kill-switch value "
            "is valid and every self-check passes; 1 when the loader leaves it out, a value is "
            "invalid or a check fails; 2 on a bad command line."
        ),
    )
    parser.add_argument(
        "--no-checks",
        action="store_true",
        help="print the status only, without the kernel self-checks (they take about a minute on "
        "a small CPU machine)",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {sglang_dsa_mtp.__version__}"
    )
    return parser


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(width, 1), break_on_hyphens=False) or [""]


def _print_table(
    rows: list[tuple[str, ...]],
    header: tuple[str, ...] | None = None,
    notes: list[str] | None = None,
) -> None:
    """The rows in aligned columns, the last one wrapped under its own start to fit :data:`WIDTH`;
    ``notes`` (one per row, after the header) go on the lines below their row, indented."""
    notes = notes or [""] * len(rows)
    if header is not None:
        rows, notes = [header, *rows], ["", *notes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lead = len(INDENT) + sum(width + 2 for width in widths)
    for row, note in zip(rows, notes):
        cells = "".join(cell.ljust(width + 2) for cell, width in zip(row, widths))
        first, *rest = _wrap(row[-1], WIDTH - lead)
        print((INDENT + cells + first).rstrip())
        for line in rest:
            print(" " * lead + line)
        for line in _wrap(note, WIDTH - 2 * len(INDENT)) if note else ():
            print(2 * INDENT + line)
    print()


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_status(device: torch.device, device_note: str) -> bool:
    """The SGLang, loader, device and launch-plan lines, the kill switches, the features, and from
    how many running requests the live-width indexer logits engage here; whether SGLang's loader
    loads us."""
    from sglang_dsa_mtp import status

    print(f"sglang_dsa_mtp {sglang_dsa_mtp.__version__}\n")
    rows, discovered = status.installation_rows(device_note)
    _print_table(rows)
    _print_table(status.switch_rows(), header=("kill switch", "state", "why"))
    _print_table(status.feature_rows(), header=("feature", "engages here", "why not"))
    for line in _wrap(status.device_indexer_engagement(device), WIDTH - len(INDENT)):
        print(INDENT + line)
    print()
    live_width = status.live_width_rows()
    if live_width:
        _print_table(live_width, header=("live_width part", "engages here", "when / why not"))
    return discovered


def _run_checks(device: torch.device, device_note: str) -> list[str]:
    """Run and table the self-checks; the names of those that failed."""
    from sglang_dsa_mtp.selfcheck import run_checks
    from sglang_dsa_mtp.testing import selfchecks

    results = run_checks(selfchecks.CHECKS, device)
    if not results:
        print(f"  self-checks ({device_note}): none yet")
        return []
    print(f"  self-checks on {device_note}:\n")
    _print_table(
        [
            (check.name, "ok" if r.ok else "FAIL", _us(r.ours_us), _us(r.sglang_us))
            for check, r in results
        ],
        header=("self-check", "result", "ours us", "SGLang us"),
        notes=[r.detail for _, r in results],
    )
    return [check.name for check, r in results if not r.ok]


def main(argv: Sequence[str] = ()) -> int:
    """The command with arguments ``argv`` (without the program name); returns the exit status."""
    args = build_parser().parse_args(list(argv))
    # Before anything defines a Triton kernel: on a machine without CUDA this sets
    # TRITON_INTERPRET=1, so SGLang and the self-checks' kernels are imported after it.
    device = select_device()
    device_note = (
        f"cuda ({torch.cuda.get_device_name(device)})"
        if device.type == "cuda"
        else "cpu, through Triton's interpreter"
    )
    with log_to_screen():
        with quiet_sglang_import():
            discovered = _print_status(device, device_note)
        from sglang_dsa_mtp.switches import SWITCHES

        problems = [error for error in (s.value_error() for s in SWITCHES) if error]
        if not discovered:
            problems.append(
                "SGLang's plugin loader does not load this plugin (see 'plugin loader')"
            )
        if args.no_checks:
            print(f"  self-checks ({device_note}): skipped (--no-checks)")
        else:
            problems += [f"self-check {name!r} failed" for name in _run_checks(device, device_note)]
    for problem in problems:
        print(f"python -m sglang_dsa_mtp: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
