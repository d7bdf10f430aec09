"""Where the host time around a glue graph's launch goes: each runner's glued replay prep, and its
parts, timed with the graph launch itself made a no-op, so that what is left is Python.

Built on the CPU as the tests build SGLang's DSA backends (``support.dsa_serving``: EAGLE --launch,
max bs --max-bs, the target verify through SGLang's ``DecodeCudaGraphRunner`` replay prep, the draft
extend and the MTP draft decode as their runners hand the prep; glue graphs simulated, their replay a
no-op). Arms: the plugin's glue (``SGLANG_DSA_METADATA_GLUE=1``) and SGLang's own glue route
(every switch of the plugin off, ``SGLANG_ENABLE_METADATA_GLUE_GRAPH=1`` and
``SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW=1``). Per call, microseconds, the best of --rounds loops of
--calls calls, at the largest captured bs (unpadded) and, where the route glues it, one request
short of it (padded):

* the runner's whole prep call as its runner makes it;
* the glue's ``replay`` of the key alone (SGLang's ``MetadataGlueGraph`` or the plugin's
  ``GlueGraph``);
* a no-op call (the floor of one Python call).

What the whole prep costs beyond the glue's replay is the route's: SGLang's
``_init_replay_attn_metadata`` for the target verify (SGLang's lines, whichever glue it replays),
``HookRegistry``'s wrapper and the plugin's hook for the draft runners.

    python test/registered/kernels/benchmark/attention/profile_glue_route_host.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import argparse

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before Triton is imported: on a CPU, Triton's interpreter

import torch  # noqa: E402

from support.bench_cli import markdown_header, markdown_row  # noqa: E402
from support.timing import best_us  # noqa: E402

SGLANG_ROUTE = {"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1", "SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW": "1"}


def prep_call(arm, op: str, bs: int, raw: int):
    """(the runner's prep call for ``raw`` requests at the captured ``bs``, as its runner makes it
    after its input copies; the key its glue replays)."""
    from support import dsa_serving, serving_loop

    runner = arm.runners[op]
    lengths = dsa_serving.request_tensor([64 + i for i in range(raw)], DEVICE)
    slots = dsa_serving.request_tensor(list(range(1, raw + 1)), DEVICE)
    accepted = torch.ones(raw, dtype=torch.int32) if op == "draft extend" else None
    calls = []
    runner.replay(bs, lengths, slots, accepted, in_place=lambda: None)  # the input copies
    if runner.decode_runner is not None:
        batch, kwargs = dsa_serving.replay_prep_arguments(
            runner.decode_runner, raw_bs=raw, bs=bs, num_tokens=bs * runner.tokens
        )
        prep = runner.decode_runner._init_replay_attn_metadata

        def call() -> None:
            prep(batch, **kwargs)

    else:
        runner.replay(bs, lengths, slots, accepted, in_place=lambda: calls.append(0))
        padded = raw != bs
        if op == "draft extend":
            own = None if padded else accepted
            batch = runner._batch(bs, runner.seq_lens, runner.req_pool_indices, own)
        elif padded:
            batch = runner._batch(bs, runner.seq_lens[:bs], runner.req_pool_indices[:bs])
            batch.num_padding = bs - raw
        else:
            batch = runner._batch(bs, lengths, slots)
            batch.num_padding = 0
        prep = runner.backend.init_forward_metadata_out_graph

        def call() -> None:
            prep(batch)

    return call, serving_loop.glue_key_of(runner, bs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", default="4/1/5")
    parser.add_argument("--max-bs", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import pytest

    from support import dsa_backends as kit
    from support import dsa_serving, serving_loop
    from support.dsa_backends import LAUNCHES

    tokens = LAUNCHES[args.launch][2]
    rows = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        dsa_serving.prepare(monkeypatch, DEVICE)
        monkeypatch.setattr(kit._CpuGraph, "replay", lambda self: None)  # the launch: a no-op
        sizes = dsa_serving.cpu_sizes(args.max_bs)
        with dsa_serving.launch(args.launch, sizes) as (_, captured):
            table = torch.zeros(sizes.pool, sizes.context + 4 + tokens, dtype=torch.int32)
            arms = {}
            for label, env, kernels in (
                ("plugin's glue", dsa_serving.ON, None),
                ("SGLang's route", {**dsa_serving.OFF, **SGLANG_ROUTE}, "sglang"),
            ):
                arm = dsa_serving.Arm(
                    label,
                    env,
                    sizes=sizes,
                    tokens=tokens,
                    req_to_token=table,
                    seeded=True,
                    kernels=kernels and dsa_serving.sglang_metadata_kernels(DEVICE),
                )
                arm.capture(captured)
                arms[label] = arm
            bs = max(captured)
            for label, arm in arms.items():
                ops = dsa_serving.OPS if label == "plugin's glue" else ("target verify",)
                for op in ops:
                    for raw in (bs, bs - 1):
                        if label == "SGLang's route" and raw != bs:
                            continue  # SGLang's route glues no padded replay
                        call, key = prep_call(arm, op, bs, raw)
                        with dsa_serving.switches(arm.env):
                            call()  # the decode runner decides at its first replay
                            whole = best_us(call, args.calls, args.rounds)
                        glue = (
                            arm.runners[op].decode_runner._metadata_glue
                            if label == "SGLang's route"
                            else serving_loop.arm_glues(arm)[op][0]
                        )
                        alone = best_us(lambda: glue.replay(key), args.calls, args.rounds)
                        rows.append((label, op, bs, raw, whole, alone, type(glue).__name__))
    floor = best_us(lambda: None, args.calls, args.rounds)
    print(f"# host Python around a glue graph launch (the launch a no-op), {DEVICE}\n")
    header = ["glue", "op", "captured bs", "live bs", "whole prep us", "glue replay alone us"]
    header += ["route around the replay us", "glue class"]
    print(markdown_header(header))
    for label, op, bs, raw, whole, alone, cls in rows:
        cells = [label, op, str(bs), str(raw), f"{whole:.2f}", f"{alone:.2f}"]
        print(markdown_row(cells + [f"{whole - alone:.2f}", cls]))
    print(f"\na no-op Python call: {floor:.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
