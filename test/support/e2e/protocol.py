"""What the end-to-end runs compare, on which server settings, in which order.

Arms. One SGLang install with this plugin installed. "stock" sets both kill switches to 0, so SGLang
runs its own code paths (the spec's "main"); "plugin" leaves them unset, so they are at their
default, on (the spec's "this PR").

Presets. The spec's "Reproduce" server flags, without the model's own flags (``--model-path``,
``--trust-remote-code``, ``--quantization``, ``--kv-cache-dtype``): those name a checkpoint and the
hardware it suits, so they are passed through after the preset, where SGLang's last occurrence of a
flag also overrides a preset value. Each preset carries the spec's concurrency points.

Instance order. The spec: "Both arms ran in the same allocation, interleaved main / PR / PR / main,
with 2 runs per server instance (n = 4 per point)". Read here as four server instances in the order
stock, plugin, plugin, stock; each one serves every concurrency point of the sweep, each point twice
in a row. Each arm so has two instances and four runs per point, and the two arms sit symmetrically
in time, so a slow drift of the machine weighs on both alike. GSM8K uses the same four instances,
each running both question orderings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang.srt.server_args import ServerArgs

from sglang_dsa_mtp.switches import SWITCHES

ARMS = ("stock", "plugin")
RUNS_PER_INSTANCE = 2


def check_arm(arm: str) -> str:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")
    return arm


def arm_env(arm: str, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the kill switches for ``arm``: every one "0" for stock, every one unset for plugin."""
    check_arm(arm)
    env = dict(base)
    for switch in SWITCHES:
        if arm == "stock":
            env[switch.env] = "0"
        else:
            env.pop(switch.env, None)
    return env


@dataclass(frozen=True)
class Instance:
    """One server instance of the interleaved order, e.g. the second plugin server."""

    arm: str
    index: int

    @property
    def tag(self) -> str:
        return f"{self.arm}-{self.index}"

    @classmethod
    def from_tag(cls, tag: str) -> Instance:
        arm, _, index = str(tag).rpartition("-")
        if arm not in ARMS or not index.isdigit():
            raise ValueError(f"tag {tag!r} is not <arm>-<instance> with arm in {ARMS}")
        return cls(arm, int(index))


INSTANCE_ORDER = (
    Instance("stock", 1),
    Instance("plugin", 1),
    Instance("plugin", 2),
    Instance("stock", 2),
)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    server_args: tuple[str, ...]
    concurrencies: tuple[int, ...]


_EAGLE_TOPK1 = ("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1")
_PREFILL = ("--chunked-prefill-size", "8192", "--max-prefill-tokens", "8192")

PRESETS = {
    preset.name: preset
    for preset in (
        Preset(
            name="tp4-eagle-4-1-5",
            description="TP4, EAGLE 4/1/5 (spec: one GB300 tray)",
            server_args=(
                "--tp-size", "4",
                *_EAGLE_TOPK1,
                "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5",
                *_PREFILL,
                "--mem-fraction-static", "0.83",
                "--max-running-requests", "32", "--cuda-graph-max-bs-decode", "32",
            ),  # fmt: skip
            concurrencies=(1, 2, 4, 8, 16, 32),
        ),
        Preset(
            name="tp8-eagle-5-1-6",
            description="TP8, EAGLE 5/1/6 (spec: two GB300 trays; add the multi-node flags there)",
            server_args=(
                "--tp-size", "8",
                *_EAGLE_TOPK1,
                "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "6",
                *_PREFILL,
                "--mem-fraction-static", "0.8",
                "--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16",
            ),  # fmt: skip
            concurrencies=(1, 4, 16),
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}")
    return PRESETS[name]


class _ServerArgParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(f"server arguments: {message}")


def parse_server_args(server_args: Sequence[str]) -> argparse.Namespace:
    """``server_args`` read by SGLang's own ``launch_server`` parser (the last occurrence of a flag
    wins); a flag SGLang does not know, or a missing ``--model-path``, raises ValueError."""
    parser = _ServerArgParser(prog="sglang.launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(list(server_args))


def split_server_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A kit script's own arguments, and those after ``--``, which go to the server."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def server_command(server_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *server_args]


def server_base_url(parsed: argparse.Namespace) -> str:
    """Where the kit reaches a server launched with ``parsed`` (a wildcard host: locally)."""
    host = "127.0.0.1" if parsed.host in ("0.0.0.0", "::", "") else parsed.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{parsed.port}"


SERVER_EPILOG = (
    "Arguments after -- go to the server. The spec: docs/spec.md, the upstream SGLang pull request "
    "this plugin re-creates, with its GB300 tables."
)


def kit_parser(doc: str) -> argparse.ArgumentParser:
    """The options every kit command takes: the preset, the results folder, the server start-up
    limit, a server started by hand (``--base-url`` with ``--instance``) and ``--report-only``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=SERVER_EPILOG)
    parser.add_argument(
        "--preset", required=True, choices=sorted(PRESETS), help="the spec's server flags to use"
    )
    parser.add_argument("--out", required=True, type=Path, help="results folder")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=3600,
        help="seconds each server may take to start (default: %(default)s)",
    )
    parser.add_argument("--base-url", help="a server started by hand, instead of launching them")
    parser.add_argument(
        "--instance", choices=[i.tag for i in INSTANCE_ORDER], help="with --base-url: which one"
    )
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report")
    return parser


def check_kit_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.base_url is None) != (args.instance is None):
        parser.error("--base-url and --instance go together")
