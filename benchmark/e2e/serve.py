"""One server of one arm in the foreground, for servers the kit does not launch itself (several
nodes: run it on every node, with that node's ``--node-rank``):

    python benchmark/e2e/serve.py --arm stock --preset tp8-eagle-5-1-6 -- --model-path ... \
        --nnodes 2 --node-rank 0 --dist-init-addr node0:5757

Replaces itself with ``python -m sglang.launch_server`` with the preset's flags, then the arguments
after ``--``, and the arm's kill switches in the environment (stock: both 0; plugin: both unset).
"""

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))

import argparse
import os
import shlex

from sglang_dsa_mtp.switches import SWITCHES
from support.e2e.protocol import (
    ARMS,
    PRESETS,
    SERVER_EPILOG,
    arm_env,
    get_preset,
    parse_server_args,
    server_command,
    split_server_args,
)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SERVER_EPILOG)
    parser.add_argument(
        "--arm",
        required=True,
        choices=ARMS,
        help="stock: both kill switches 0 (SGLang's own paths); plugin: both unset (on)",
    )
    parser.add_argument(
        "--preset", required=True, choices=sorted(PRESETS), help="the spec's server flags to use"
    )
    return parser


def main(argv: list[str]) -> None:
    kit_argv, extra = split_server_args(argv)
    args = build_parser().parse_args(kit_argv)
    server_args = [*get_preset(args.preset).server_args, *extra]
    parse_server_args(server_args)
    env = arm_env(args.arm, os.environ)
    command = server_command(server_args)
    switches = ", ".join(f"{s.env}={env.get(s.env, '(unset)')}" for s in SWITCHES)
    print(f"arm {args.arm} ({switches}): {shlex.join(command)}", flush=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:
        sys.exit(f"serve.py: error: {error}")
