"""Where the host microseconds of a replay-metadata call go: each part of our call timed alone.

For each op (decode, target verify, draft extend, the MTP one launch into ``--steps`` step backends)
at each batch size, on SGLang's graph buffers of that batch size, called as the server calls it (the
three ops: SGLang's keyword arguments, each one written in the call as SGLang's replay writes it, at
what the selection hook installs, ``Fallback.installed``; the MTP one launch: the function its
capture binds, ``launch.bind``, called with the two inputs): the whole call, then its parts, each
timed alone in a loop (the best of ``--rounds`` rounds of ``--calls`` calls, microseconds per call):

* ``wrapper``: our wrapper called directly (the keyword binding, its ``locals()``, its plans' call);
* ``key``: ``LaunchPlans.key`` of the call's arguments by name (the installed function computes the
  same key from its parameters);
* ``lookup``: the plan's dict lookup by that key;
* ``plan launch``: ``_Plan.launch`` (the inputs' checks, the arguments packed, the launcher called);
* ``launcher``: what the plan calls to launch, alone, with the packed arguments: on Triton 3.6 and 3.8
  the C launch beneath Triton's compiled-kernel launcher (``launch.native_launch``), else that
  launcher;
* ``Triton's launcher``: the compiled kernel's launcher (its Python ``__call__`` included), alone.

On a GPU the launcher is Triton's; on a CPU (no GPU present) the plans are made as on a GPU with a
launcher that does nothing (``support.launch_stubs``): the Python of our call, without Triton's.

    python test/registered/kernels/benchmark/attention/profile_replay_metadata_host.py --bs 1,16,48
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import argparse
import functools
import inspect
import time

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before Triton is imported: on a CPU, Triton's interpreter

import torch

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import (
    fused_dsa_draft_decode_metadata_multi,
)
from sglang_dsa_mtp.kernels.ops.launch import bind
from support.bench_cli import markdown_header, markdown_row, parse_list
from support.constants import SMALL_WIDTH, WIDTH_1M
from support.launch_stubs import ALL_PLANS, Patches, planned_on_cpu
from support.metadata_cases import CapturedBuffers, kernel_for, one_launch_kwargs
from support.timing import written_call

OPS = ("decode", "verify", "draft_extend", "mtp")
PARTS = ("key", "lookup", "plan launch", "launcher", "Triton's launcher")


def best_us(fn, calls: int, rounds: int) -> float:
    """Microseconds per call of ``fn``: the best of ``rounds`` loops of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    return best


def call_of(op, buffers, bs):
    """(our wrapper, its plans, the keyword arguments of the server's call at ``bs``)."""
    if op == "mtp":
        first = buffers[0]
        kwargs = one_launch_kwargs(buffers, bs, first.seq_lens[:bs], first.req_pool_indices[:bs])
        return ALL_PLANS[3], kwargs
    plans = ALL_PLANS[OPS.index(op)]
    return plans, buffers[0].replay_kwargs(op, bs)


def profile(op, plans, kwargs, calls: int, rounds: int) -> dict:
    """Microseconds per call of our whole call of ``op`` and of each of its parts."""
    ours = kernel_for(op, "bounded") if op != "mtp" else fused_dsa_draft_decode_metadata_multi
    parameters = inspect.signature(ours).parameters
    arguments = {name: kwargs.get(name, p.default) for name, p in parameters.items()}
    ours(**kwargs)  # the JIT path: keeps the plan
    key = plans.key(arguments)
    plan = plans._plans[key]
    inputs = plans._inputs(arguments)
    args = (*map(torch.Tensor.data_ptr, inputs), *plan.rest)
    stream = plan.get_stream(plan.device)
    if op == "mtp":
        fixed = {name: v for name, v in kwargs.items() if name not in plans.input_names}
        bound = bind(ours, plans.input_names, **fixed)
        call = functools.partial(bound, *(kwargs[name] for name in plans.input_names))
    else:
        call = written_call(Fallback(ours, ours, what=op).installed, kwargs)

    def launcher():
        if plan.args_as_tuple:
            plan.call(*plan.grid, stream, *plan.before, None, None, None, *plan.after, args)
        else:
            plan.call(*plan.grid, stream, *plan.before, None, None, None, *plan.after, *args)

    def triton_launcher():
        compiled = plan.compiled
        compiled.run(
            *plan.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args
        )

    parts = {
        "call": call,
        "wrapper": lambda: ours(**kwargs),
        "key": lambda: plans.key(arguments),
        "lookup": lambda: plans._plans.get(key),
        "plan launch": lambda: plan.launch(inputs),
        "launcher": launcher,
        "Triton's launcher": triton_launcher,
    }
    return {name: best_us(fn, calls, rounds) for name, fn in parts.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", default="1,16,48", help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="MTP draft step backends (1-4)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=15, help="timed loops; the best one counts")
    args = parser.parse_args(argv)
    batch_sizes = parse_list(args.bs)
    width = WIDTH_1M if DEVICE.type == "cuda" else SMALL_WIDTH
    req_to_token = torch.randint(
        0, 1 << 30, (2 * max(batch_sizes), width), dtype=torch.int32, device=DEVICE
    )
    one = torch.zeros(1, device=DEVICE)
    floor = best_us(lambda: one.add_(1), args.calls, args.rounds)
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU, launcher stubbed"
    print(
        f"# {where}, torch {torch.__version__}; width {width}; best of {args.rounds} x {args.calls}"
    )
    print(f"# host floor: one PyTorch kernel launch (a one-element add_) costs {floor:.2f} us")
    print(markdown_header(["op", "bs", "call", "wrapper", *PARTS, "call / floor"]))
    with Patches() as patches:
        if DEVICE.type != "cuda":
            planned_on_cpu(patches, None)
        for op in OPS:
            for bs in batch_sizes:
                buffers = [
                    CapturedBuffers(
                        req_to_token,
                        max_bs=bs,
                        next_n=1 if op == "mtp" else 5,
                        page_size=64,
                        topk=2048,
                    )
                    for _ in range(args.steps if op == "mtp" else 1)
                ]
                plans, kwargs = call_of(op, buffers, bs)
                times = profile(op, plans, kwargs, args.calls, args.rounds)
                cells = [op, str(bs), *(f"{times[k]:.2f}" for k in ("call", "wrapper"))]
                cells += [f"{times[k]:.2f}" for k in PARTS]
                print(markdown_row([*cells, f"{times['call'] / floor:.2f}"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
