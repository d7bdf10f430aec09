"""``python -m sglang_dsa_mtp``: what the plugin would do on this machine, then the kernel self-checks.

Prints SGLang's version, whether SGLang's plugin loader picks this package up, how the bounded
kernels' replays launch, the kill switches, whether each feature would
engage here and why not, from how many running requests the live-width indexer logits engage on
this GPU, one row per kernel self-check and a summary line. ``--no-checks`` skips the checks and
the import of the hook targets' SGLang modules (the features then as the version, the switches and
the platform decide, which the status says), so that it takes about as long as importing SGLang. ``--help`` and
``--version`` import neither torch nor SGLang. The exit status is 0 when SGLang's plugin loader
loads this plugin, every kill-switch value is valid and every self-check passes; 1 when the loader
leaves the plugin out, a value is invalid or a check fails; 2 on a bad command line. The rows come
from :mod:`sglang_dsa_mtp.status`, the checks from :mod:`sglang_dsa_mtp.selfcheck`, which only
this command imports, and only when it runs them. A non-zero exit ends with one line on stderr,
``python -m sglang_dsa_mtp: error: ...``, that names every reason for it, separated by ``; ``.

Every line on the screen but that last one is at most :data:`WIDTH` columns. The tables go to
stdout: a table's last column wraps under its own start, a self-check's detail goes on the lines
below its row. This package's log records go to stderr as ``LEVEL sglang_dsa_mtp: ...`` (each
message carries its ``sglang_dsa_mtp:`` prefix, which is what names them in SGLang's server log,
whose format has no logger names), wrapped under the message's start. An invalid kill-switch value
shows first, as the one error the server logs for it; its rows and the last line point to it.
SGLang's own import-time warnings about a machine without CUDA (``SGLANG_IMPORT_WARNINGS``,
``SGLANG_IMPORT_LOG_LINES``) are not about this plugin and are kept off this screen; any other
warning is shown as usual.
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
from typing import TYPE_CHECKING

import sglang_dsa_mtp
from sglang_dsa_mtp.log import logger

if TYPE_CHECKING:
    import torch

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


class _ScreenFormatter(logging.Formatter):
    """A record's lines wrapped to :data:`WIDTH` columns, continued under the message's start."""

    def format(self, record: logging.LogRecord) -> str:
        indent = " " * (len(record.levelname) + 1)
        lines = super().format(record).splitlines()
        return "\n".join("\n".join(_wrap(line, WIDTH, indent)) for line in lines)


@contextlib.contextmanager
def log_to_screen() -> Iterator[None]:
    """Inside the block, this package's records at INFO and above go to stderr as
    ``LEVEL sglang_dsa_mtp: ...``, and only there; the logger is restored afterwards."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ScreenFormatter("%(levelname)s %(message)s"))
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
            "loader, the launches, the kill switches, each feature and why it would not "
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
        help="print the status only, without the kernel self-checks and without importing the "
        "SGLang modules the plugin hooks (as fast as importing SGLang)",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {sglang_dsa_mtp.__version__}"
    )
    return parser


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` columns, the lines after the first after ``indent``."""
    return textwrap.wrap(text, max(width, 1), subsequent_indent=indent, break_on_hyphens=False) or [
        ""
    ]


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


def _print_status(device: torch.device, device_note: str, *, resolve: bool) -> bool:
    """The SGLang, loader, device and launch-plan lines, the kill switches, the features, and from
    how many running requests the live-width indexer logits engage here; whether SGLang's loader
    loads us. ``resolve``: the features as ``register()`` would decide, every hook target imported
    (most of the time the status takes); otherwise from the version, the switches and the
    platform, which the status says."""
    from sglang_dsa_mtp import status

    print(f"sglang_dsa_mtp {sglang_dsa_mtp.__version__}\n")
    rows, discovered = status.installation_rows(device_note)
    _print_table(rows)
    _print_table(status.switch_rows(), header=("kill switch", "state", "why"))
    _print_table(status.feature_rows(resolve), header=("feature", "engages here", "why not"))
    if not resolve:
        for line in _wrap(status.UNRESOLVED, WIDTH - len(INDENT)):
            print(INDENT + line)
        print()
    for line in _wrap(status.device_indexer_engagement(device), WIDTH - len(INDENT)):
        print(INDENT + line)
    print()
    live_width = status.live_width_rows(resolve)
    if live_width:
        _print_table(live_width, header=("live_width part", "engages here", "when / why not"))
    return discovered


def _run_checks(device: torch.device, device_note: str) -> list[str]:
    """Run and table the self-checks that can run on ``device``, then one summary line; the names
    of those that failed."""
    from sglang_dsa_mtp import selfcheck

    on_cuda = device.type == "cuda"
    checks = [check for check in selfcheck.CHECKS if on_cuda or not check.needs_cuda]
    not_run = [check.name for check in selfcheck.CHECKS if check not in checks]
    if not selfcheck.CHECKS:
        print(f"  self-checks ({device_note}): none yet")
        return []
    results = selfcheck.run_checks(checks, device)
    timed = any(r.ours_us is not None for _, r in results)
    print(f"  self-checks on {device_note}:\n")
    if results:
        _print_table(
            [
                (check.name, "ok" if r.ok else "FAIL")
                + ((_us(r.ours_us), _us(r.sglang_us)) if timed else ())
                for check, r in results
            ],
            header=("self-check", "result") + (("ours us", "SGLang us") if timed else ()),
            notes=[r.detail for _, r in results],
        )
    passed = sum(r.ok for _, r in results)
    summary = f"{passed}/{len(results)} self-checks bit-identical to SGLang's code"
    if not timed:
        summary += " (untimed: Triton's interpreter on the CPU says nothing of a GPU's times)"
    if not_run:
        summary += (
            f"; not run here, they need a CUDA GPU (SGLang's kernel asserts CUDA tensors; the "
            f"test suite checks them through the interpreter): {', '.join(not_run)}"
        )
    for line in _wrap(summary, WIDTH - len(INDENT)):
        print(INDENT + line)
    return [check.name for check, r in results if not r.ok]


def main(argv: Sequence[str] = ()) -> int:
    """The command with arguments ``argv`` (without the program name); returns the exit status."""
    args = build_parser().parse_args(list(argv))
    # Imported after the command line is read, so that --help and --version need neither torch nor
    # SGLang; select_device() before anything defines a Triton kernel: on a machine without CUDA it
    # sets TRITON_INTERPRET=1, so SGLang and the self-checks' kernels are imported after it.
    import torch

    from sglang_dsa_mtp.devices import select_device

    device = select_device()
    device_note = (
        f"cuda ({torch.cuda.get_device_name(device)})"
        if device.type == "cuda"
        else "cpu, through Triton's interpreter"
    )
    with log_to_screen():
        with quiet_sglang_import():
            from sglang_dsa_mtp.switches import ACCEPTED, SWITCHES

            # First on the screen: the error the server logs for an invalid value, once.
            invalid = [switch for switch in SWITCHES if switch.value_error()]
            for switch in invalid:
                switch.state()
            discovered = _print_status(device, device_note, resolve=not args.no_checks)
        # Every reason for a non-zero exit, named again on the last line.
        problems = [
            f"{switch.value_error().removesuffix(f' ({ACCEPTED})')} (see above)"
            for switch in invalid
        ]
        if not discovered:
            problems.append(
                "SGLang's plugin loader does not load this plugin (see 'plugin loader')"
            )
        if args.no_checks:
            print(f"  self-checks ({device_note}): skipped (--no-checks)")
        else:
            problems += [f"self-check {name!r} failed" for name in _run_checks(device, device_note)]
    if problems:
        print(f"python -m sglang_dsa_mtp: error: {'; '.join(problems)}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
