"""``python -m sglang_dsa_mtp``: what the plugin would do on this machine, then the kernel self-checks.

Prints SGLang's version, whether SGLang's plugin loader picks this package up, the kill switches,
whether each feature would engage here and why not, and one row per kernel self-check. The exit
status is 1 when a self-check fails.
"""

from __future__ import annotations

import sys

import torch

import sglang_dsa_mtp
from sglang_dsa_mtp.devices import cuda_blocker, select_device


def _print_table(rows: list[tuple[str, ...]], header: tuple[str, ...] | None = None) -> None:
    rows = rows if header is None else [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print()


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    # First, before anything defines a Triton kernel: on a machine without CUDA this sets
    # TRITON_INTERPRET=1, so the imports below (SGLang, the self-checks' kernels) come after it.
    device = select_device()
    from sglang_dsa_mtp import plugin, selfcheck
    from sglang_dsa_mtp.switches import SWITCHES

    version = plugin.sglang_version()
    if version is None:
        version_note = "not installed"
    elif version in plugin.TESTED_SGLANG_VERSIONS:
        version_note = f"{version} (tested)"
    else:
        version_note = f"{version} (NOT tested; tested: {', '.join(plugin.TESTED_SGLANG_VERSIONS)})"
    discovered, discovery_note = plugin.discovery()
    device_note = (
        f"cuda ({torch.cuda.get_device_name(device)})"
        if device.type == "cuda"
        else "cpu, through Triton's interpreter"
    )
    print(f"sglang_dsa_mtp {sglang_dsa_mtp.__version__}\n")
    _print_table(
        [
            ("SGLang", version_note),
            ("plugin loader", ("yes: " if discovered else "NO: ") + discovery_note),
            ("device", device_note),
        ]
    )

    switch_rows = []
    for switch in SWITCHES:
        enabled, why = switch.state()
        switch_rows.append((switch.env, "on" if enabled else "off", why))
    _print_table(switch_rows, header=("kill switch", "state", "why"))

    blocker = cuda_blocker()
    feature_rows = []
    for feature, status in plugin.feature_status().items():
        why_not = [] if status.enabled else [status.reason]
        if blocker:
            why_not.append(blocker)
        feature_rows.append((feature, "no" if why_not else "yes", "; ".join(why_not)))
    _print_table(feature_rows, header=("feature", "engages here", "why not"))
    if plugin.feature_status()["live_width"].enabled:
        from sglang_dsa_mtp.integration.dsa_graph_page_tables import describe

        _print_table(describe(), header=("live_width part", "engages here", "when / why not"))

    results = selfcheck.run_checks(device)
    if not results:
        print(f"  self-checks ({device_note}): none yet")
        return 0
    _print_table(
        [
            (check.name, "ok" if r.ok else "FAIL", _us(r.ours_us), _us(r.sglang_us), r.detail)
            for check, r in results
        ],
        header=(f"self-check ({device_note})", "result", "ours us", "SGLang us", "detail"),
    )
    return 0 if all(r.ok for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
