"""Where the host microseconds of a replay-metadata call go: each part of our call timed alone.

For each op (decode, target verify, draft extend, the MTP one launch into ``--steps`` step backends)
at each batch size, on SGLang's graph buffers of that batch size, its launch bound as at the capture
of the batch size (``Fallback.warm_up``; the MTP one launch: ``launch.Binder.bind``), called as the
server calls it (the three ops: SGLang's keyword arguments, each one written in the call as SGLang's
replay writes it, at what the selection hook installs, ``Fallback.installed``; the MTP one launch:
its replay's keyword arguments, through its bound launch): the whole call, then its parts, each
timed alone in a loop (the best of ``--rounds`` rounds of ``--calls`` calls, microseconds per call):

* ``wrapper``: our wrapper called directly (its checks, its grid, Triton's JIT);
* ``bound launch``: the bound launch's call (its checks of the arguments, the inputs placed, the
  launcher called);
* ``launcher``: what the bound launch calls to launch, alone, with the arguments placed (the
  launcher its probe chose: the C launch beneath Triton's compiled-kernel launcher, or Triton's
  launch of the compiled kernel);
* ``Triton's launch``: Triton's launch of the compiled kernel (``compiled[grid](*arguments)``),
  alone.

On a GPU the launches are Triton's; on a CPU (no GPU present) the launches are bound as on a GPU
through stand-ins that do nothing once bound (``support.launch_stubs``): the Python of our call,
without Triton's.

    python test/registered/kernels/benchmark/attention/profile_replay_metadata_host.py --bs 1,16,48
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import argparse

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before Triton is imported: on a CPU, Triton's interpreter

import torch

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import ONE_LAUNCH_BINDER
from sglang_dsa_mtp.kernels.ops.launch import triton_launch
from support.bench_cli import markdown_header, markdown_row, parse_list
from support.constants import SMALL_WIDTH, WIDTH_1M
from support.launch_stubs import Patches, compiled_on_cpu
from support.metadata_cases import CapturedBuffers, kernel_for, one_launch_kwargs
from support.timing import best_us, written_call

OPS = ("decode", "verify", "draft_extend", "mtp")
PARTS = ("bound launch", "launcher", "Triton's launch")


def profile(op, buffers, bs: int, calls: int, rounds: int) -> dict:
    """Microseconds per call of our whole call of ``op`` at ``bs`` and of each of its parts."""
    if op == "mtp":
        first = buffers[0]
        kwargs = one_launch_kwargs(buffers, bs, first.seq_lens[:bs], first.req_pool_indices[:bs])
        binder = ONE_LAUNCH_BINDER
        bound, why = binder.bind(**kwargs)
        fixed = {n: v for n, v in kwargs.items() if n not in binder.inputs}

        def call():  # as the one launch's replay calls it (write_draft_decode_metadata)
            bound(
                dict(
                    fixed,
                    seq_lens=first.seq_lens[:bs],
                    req_pool_indices=first.req_pool_indices[:bs],
                )
            )

    else:
        kwargs = buffers[0].replay_kwargs(op, bs)
        ours = kernel_for(op, "bounded")
        fallback = Fallback(ours, ours, what=op)
        fallback.warm_up(**kwargs)
        binder, bound = ours.binder, fallback.bound.get(bs)
        why = "its warm-up logged why"
        call = written_call(fallback.installed, kwargs)
    if bound is None:
        raise RuntimeError(f"{op} at bs {bs}: no launch bound ({why})")
    set_running(False)
    prepared = binder.prepare(binder.arguments(kwargs))
    compiled = binder.kernel.warmup(grid=prepared.grid, **prepared.arguments, **prepared.options)
    grid = tuple(prepared.grid) + (1,) * (3 - len(prepared.grid))
    arguments = [prepared.arguments[name] for name in binder.kernel.arg_names]
    triton = triton_launch(compiled, grid)
    parts = {
        "call": call,
        "wrapper": lambda: binder.wrapper(**kwargs),
        "bound launch": lambda: bound(kwargs),
        "launcher": lambda: bound._launch(arguments),
        "Triton's launch": lambda: triton(arguments),
    }
    times = {name: best_us(fn, calls, rounds) for name, fn in parts.items()}
    set_running(True)
    return times


_STAND_INS: dict = {}  # on a CPU: the stand-in kernels by op (``support.launch_stubs``)


def set_running(runs: bool) -> None:
    """On a CPU, whether the stand-in kernels run (binding probes them) or do nothing (timing)."""
    for stand_in in _STAND_INS.values():
        stand_in.runs = runs


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
            _STAND_INS.update(compiled_on_cpu(patches, None))
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
                times = profile(op, buffers, bs, args.calls, args.rounds)
                cells = [op, str(bs), *(f"{times[k]:.2f}" for k in ("call", "wrapper"))]
                cells += [f"{times[k]:.2f}" for k in PARTS]
                print(markdown_row([*cells, f"{times['call'] / floor:.2f}"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
