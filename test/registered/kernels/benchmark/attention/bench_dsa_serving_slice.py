"""SGLang's DSA backends serving EAGLE rounds under CUDA graphs, the plugin on and off in one run: the
serving loop's checks, then SGLang's whole replay-metadata call, the graph state's memory and the
EAGLE worker's verify input, each measured on both arms.

Reproduces the tables "Serving slice" of docs/results.md on the GPU at hand: the serving loop
(``support.serving_loop``: bit identity after every replay, Triton compiles after
capture, injected failures); host microseconds of SGLang's ``init_forward_metadata_out_graph`` per op
and captured batch size; ``torch.cuda.memory_allocated`` after ``init_cuda_graph_state`` and after
capture, and each arm's graph pool, at max bs 16 and 48, beside the meta-device computation of
``benchmark/live_width_memory.py``; SGLang's ``build_eagle_verify_input`` (the tree mask) per batch
size.

Everything runs SGLang 0.5.23's own classes through its own constructors and graph-runner calls
(``support.dsa_serving``, whose docstring names the stand-ins for what a CUDA
machine without SGLang's native packages lacks: ``sgl_kernel`` stubbed, DeepGEMM's schedule and SM count, SGLang's JIT top-k plan, FlashMLA's
tile metadata and SGLang's JIT metadata copies, and for the verify input SGLang's JIT tree builder).
The arms: the kill switches ``SGLANG_DSA_BOUNDED_REPLAY_METADATA`` and ``SGLANG_DSA_LIVE_WIDTH`` both
on (the plugin) and both off (SGLang's own paths).

* Host time: each op (target verify, draft extend, MTP draft decode) at every captured batch size of
  one server (``--host-launch``, seeded draft steps, ``--max-bs``), every request at ``--host-live``
  tokens; one untimed call first, then ``--host-calls`` calls per arm, the arms in turn, the queue
  drained before each; the figure is the median host time of SGLang's call alone (its Python and its
  launches, the graph replay after it not included). SGLang's JIT metadata copies stand aside, so the
  off arm's draft decode copies with torch (SGLang's own fallback): it is overstated there.
* Memory: per ``--memory-launch`` and ``--memory-max-bs``, each arm built alone in the process
  (graphs without the loop's read-back outputs): bytes allocated by its backends' constructors and
  ``init_cuda_graph_state``, then after every batch size's capture (metadata and graphs), its graph
  pool's segments, and the bytes of the distinct tensors its graph state holds
  (``dsa_backends.graph_state_bytes``), beside the same count from the meta device.
* Verify logits memory: per ``--logits-max-bs``, the target model's ``LogitsProcessor`` and LM
  head (GLM-5: vocabulary 154,880, hidden 6,144, random bf16 weights) in target verify, every
  batch size of SGLang's capture list for EAGLE 3/1/4 captured as its target-verify runner captures
  (largest first, one pool, SGLang's shared fp32 logits buffer, each graph's output kept), at TP 1
  and at a TP-8 rank's shard width (emulated on one GPU by a TP-1 model of 19,360 columns:
  ``support.verify_logits_memory``): ``memory_allocated`` after capture, the graph
  pool and the peak, for the target-verify exchange off, on, and the positive control (the shard
  allocated in each capture, as the exchange first kept it); retained bytes beyond stock as a row.
* Verify input: SGLang's ``build_eagle_verify_input`` for a topk=1 chain draft against each arm's
  target (off: FULL_MASK ``bs x context x draft tokens`` mask and the tree builder, then
  ``assign_extend_cache_locs_uniform_func`` as ``eagle_prepare_for_verify`` does; on: the QLEN_ONLY
  mask and ``build_chain_tree``), ``--verify-calls`` calls, the queue drained around each (device work
  included), median; the peak memory one call allocates; both arms' outputs compared.

    python test/registered/kernels/benchmark/attention/bench_dsa_serving_slice.py --json slice.json
    python test/registered/kernels/benchmark/attention/bench_dsa_serving_slice.py --dry-run  # CPU
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import statistics
import time

from sglang_dsa_mtp.devices import select_device

DEVICE = select_device()  # before any kernel module is imported (sets TRITON_INTERPRET on a CPU)

import torch  # noqa: E402

from support.bench_cli import (  # noqa: E402
    benchmark_parser,
    markdown_header,
    markdown_row,
    write_json,
)
from support.constants import CONTEXT_1M  # noqa: E402

LAUNCH_NAMES = ("3/1/4", "4/1/5", "5/1/6")
MB = 1e6
LIVE_WIDTH_MEMORY = Path(__file__).resolve().parents[5] / "benchmark" / "live_width_memory.py"
# The dry run: the loop's least rounds per server with injections, max bs 5 (four distinct fault
# victims below the largest), memory at max bs 2 and 3, the verify logits at max bs 3.
DRY_RUN = dict(
    rounds_per_server=20,
    max_bs=5,
    memory_max_bs=[2, 3],
    host_calls=2,
    verify_bs=[1, 3],
    logits_max_bs=[3],
)


def build_parser():
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--rounds", type=int, default=720, help="serving-loop rounds (3 replays each, per arm)"
    )
    parser.add_argument(
        "--launch",
        nargs="+",
        default=list(LAUNCH_NAMES),
        choices=LAUNCH_NAMES,
        help="EAGLE launches of the loop (each seeded and unseeded)",
    )
    parser.add_argument(
        "--max-bs",
        type=int,
        default=48,
        help="--cuda-graph-max-bs-decode of the loop and host time",
    )
    parser.add_argument("--context", type=int, default=CONTEXT_1M, help="--context-length")
    parser.add_argument(
        "--memory-launch",
        nargs="+",
        default=["4/1/5", "5/1/6"],
        choices=LAUNCH_NAMES,
        help="EAGLE launches whose memory is measured",
    )
    parser.add_argument(
        "--memory-max-bs", nargs="+", type=int, default=[16, 48], help="max bs measured"
    )
    parser.add_argument(
        "--logits-max-bs",
        nargs="+",
        type=int,
        default=[48, 256],
        help="--cuda-graph-max-bs of the verify logits memory",
    )
    parser.add_argument(
        "--host-launch", default="4/1/5", choices=LAUNCH_NAMES, help="EAGLE launch of host time"
    )
    parser.add_argument("--host-live", type=int, default=1024, help="tokens of every request")
    parser.add_argument("--host-calls", type=int, default=30, help="timed calls per op, bs, arm")
    parser.add_argument(
        "--verify-bs", nargs="+", type=int, default=[1, 16, 48], help="verify-input batch sizes"
    )
    parser.add_argument("--verify-calls", type=int, default=30, help="timed verify-input calls")
    parser.add_argument("--seed", type=int, default=0, help="the loop's random seed")
    parser.add_argument("--json", help="write every measurement and the loop's report here")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="everything on the CPU through Triton's interpreter at small sizes (a 128-token "
        f"context, simulated graphs), without figures: {DRY_RUN}",
    )
    return parser


def median_us(samples) -> float:
    return statistics.median(samples)


def cell(value, fmt="{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --- the loop ---------------------------------------------------------------------------------------


def print_loop(report, sizes) -> None:
    from support import dsa_serving, serving_loop

    print(
        f"## Serving loop: {report.replays:,} replays per arm, context {sizes.context:,}, "
        f"max bs {sizes.max_bs}\n"
    )
    header = ["server", "captured bs", "rounds", "replays per arm", "tensors compared"]
    header += ["mismatches", f"requests past {sizes.long_from:,} tokens", "capture s", "rounds s"]
    print(markdown_header(header))
    for server in report.servers:
        past = server.long_requests / max(server.requests, 1)
        print(
            markdown_row(
                [
                    server.name,
                    str(len(server.captured)),
                    f"{server.rounds:,}",
                    f"{sum(server.replays.values()):,}",
                    f"{server.comparisons:,}",
                    str(len(server.mismatches)),
                    f"{server.long_requests:,} of {server.requests:,} ({past:.0%})",
                    f"{server.seconds.get('capture', 0):.1f}",
                    f"{server.seconds.get('rounds', 0):.1f}",
                ]
            )
        )
    print()
    print(serving_loop.engagement_table(report))
    print()
    print(markdown_header(["injected failure", "where", "raised", "log lines"]))
    for injection in report.injections:
        line = injection.lines[0] if len(injection.lines) == 1 else f"{len(injection.lines)} lines"
        print(markdown_row([injection.what, injection.where, str(injection.raised), line]))
    print()
    print(
        f"Triton compiles after capture, plugin on (fallback replays included): "
        f"{len(report.compiles_on)}{' ' + str(report.compiles_on[:10]) if report.compiles_on else ''}"
    )
    print(
        f"Triton compiles while serving, plugin off (SGLang's kernels at their first replays): "
        f"{report.compiles_off}; at the plugin-on arm's captures: {report.compiles_on_capture}"
    )
    print(
        f"Indexer top-k past the SM count: {report.indexer_calls} calls per arm, "
        f"{report.indexer_live_calls} answered by the live copy, "
        f"{len(report.indexer_mismatches)} mismatches"
    )
    print(
        "Compared after every replay, bit for bit, of each DSA backend the graph reads (every step "
        f"backend of the draft decode): {', '.join(dsa_serving.READ)} (real_page_table: each row's "
        "pages in SGLang's 128-column blocks; seeded draft steps: not the indexer plans "
        f"{', '.join(dsa_serving.INDEXER_PLANS)}, which no seeded step reads); after capture: "
        f"{', '.join(dsa_serving.STATIC)}"
    )
    failures = report.failures()
    print(f"\nLoop: {'PASSED' if not failures else 'FAILED'}")
    for failure in failures:
        print(f"  {failure}")
    print()


# --- measurements -----------------------------------------------------------------------------------


def build_pair(name: str, sizes, captured, *, seeded: bool = True) -> dict:
    """The two arms of one server, off then on, each built and captured (graphs without read-back
    outputs), its allocations counted from just before it was built."""
    from support import dsa_serving
    from support.dsa_backends import LAUNCHES

    tokens = LAUNCHES[name][2]
    req_to_token = torch.zeros(
        sizes.pool, sizes.context + 4 + tokens, dtype=torch.int32, device=sizes.device
    )
    req_to_token[1:].random_(0, 1 << 30)
    arms = {}
    for label, env, kernels in (
        ("off", dsa_serving.OFF, dsa_serving.sglang_metadata_kernels(sizes.device)),
        ("on", dsa_serving.ON, None),
    ):
        arms[label] = dsa_serving.Arm(
            label,
            env,
            sizes=sizes,
            tokens=tokens,
            req_to_token=req_to_token,
            seeded=seeded,
            kernels=kernels,
            reader=False,
        )
        arms[label].capture(captured)
    return arms


def meta_bytes(server_args, sizes, switch: str) -> int:
    """The graph state's bytes computed on the meta device (``benchmark/live_width_memory.py``)."""
    import logging

    from support import dsa_serving
    from support.scripts import load_script

    computed = load_script(LIVE_WIDTH_MEMORY)
    plugin_log = logging.getLogger("sglang_dsa_mtp")
    disabled, plugin_log.disabled = plugin_log.disabled, True  # the meta device's warm-up errors
    try:
        with dsa_serving.switches({dsa_serving.LIVE_ENV: switch}):
            state = computed.build_graph_state(server_args, sizes.context, sizes.max_bs, switch)
    finally:
        plugin_log.disabled = disabled
    return sum(value for name, value in state.items() if not name.startswith("_"))


def measure_memory(name: str, sizes, captured, server_args) -> dict:
    arms = build_pair(name, sizes, captured)
    out = {}
    for label, arm in arms.items():
        memory = arm.memory
        out[label] = dict(
            graph_state=memory.graph_state - memory.before,
            captured=memory.captured - memory.before,
            pool=memory.pool,
            held=arm.graph_state_bytes(),
            meta=meta_bytes(server_args, sizes, "1" if label == "on" else "0"),
        )
    return dict(arms=arms, figures=out)


def measure_host_time(arms: dict, captured, tokens: int, calls: int, live: int) -> list[dict]:
    from support import dsa_serving

    rows = []
    for op in dsa_serving.OPS:
        for bs in captured:
            lengths = [min(live, arms["on"].sizes.context)] * bs
            if op == "draft extend":
                lengths = [n + tokens for n in lengths]
            seq_lens = dsa_serving.request_tensor(lengths, DEVICE)
            slots = dsa_serving.request_tensor(range(1, bs + 1), DEVICE)
            accepted = torch.ones(bs, dtype=torch.int32, device=DEVICE)
            extra = accepted if op == "draft extend" else None
            samples = {"off": [], "on": []}
            for label in samples:
                arms[label].replay(op, bs, seq_lens, slots, extra)
            for _ in range(calls):
                for label in samples:
                    sync()
                    samples[label].append(arms[label].replay(op, bs, seq_lens, slots, extra))
            sync()
            off, on = median_us(samples["off"]), median_us(samples["on"])
            rows.append(dict(op=op, bs=bs, off_us=off, on_us=on, ratio=on / off))
    return rows


def measure_verify_input(arms: dict, steps: int, batch_sizes, calls: int, live: int) -> list[dict]:
    from support import dsa_serving

    rows = []
    req_to_token = arms["on"].target.req_to_token
    context = arms["on"].sizes.context
    for bs in batch_sizes:
        if bs > arms["on"].sizes.max_bs:
            continue
        seq_lens = dsa_serving.request_tensor([min(live, context - steps - 1)] * bs, DEVICE)
        slots = dsa_serving.request_tensor(range(1, bs + 1), DEVICE)
        row, outputs = dict(bs=bs), {}
        for label in ("off", "on"):
            target = arms[label].target

            def call():
                return dsa_serving.verify_input(
                    target, seq_lens, slots, req_to_token, steps=steps, seed=bs
                )

            outputs[label] = call()
            times, peak = [], None
            if DEVICE.type == "cuda":
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                call()
                sync()
                peak = torch.cuda.max_memory_allocated() - base
            for _ in range(calls):
                sync()
                start = time.perf_counter()
                call()
                sync()
                times.append((time.perf_counter() - start) * 1e6)
            row[f"{label}_us"] = median_us(times)
            row[f"{label}_peak_bytes"] = peak
            row[f"{label}_mask_bytes"] = outputs[label][0].custom_mask.numel()
        (off, off_loc), (on, on_loc) = outputs["off"], outputs["on"]
        fields = ("draft_token", "positions", "retrieve_index", "retrieve_next_token")
        fields += ("retrieve_next_sibling",)
        differ = [f for f in fields if not torch.equal(getattr(on, f), getattr(off, f))]
        if not torch.equal(on_loc, off_loc):
            differ.append("verify cache locations")
        row["differ"] = differ
        rows.append(row)
    return rows


def print_memory(records: list[dict]) -> None:
    print("## Graph state memory\n")
    header = ["EAGLE", "max bs", "arm", "after init_cuda_graph_state (MB)", "after capture (MB)"]
    header += ["graph pool (MB)", "graph state held (MB)", "meta computation (MB)"]
    print(markdown_header(header))
    for record in records:
        arms = record["figures"]
        for label in ("off", "on"):
            f = arms[label]
            print(
                markdown_row(
                    [
                        record["launch"],
                        str(record["max_bs"]),
                        "plugin " + label,
                        cell(f["graph_state"] / MB if f["pool"] is not None else None),
                        cell(f["captured"] / MB if f["pool"] is not None else None),
                        cell(None if f["pool"] is None else f["pool"] / MB),
                        cell(f["held"] / MB),
                        cell(f["meta"] / MB),
                    ]
                )
            )
        off, on = arms["off"], arms["on"]
        measured = off["pool"] is not None
        print(
            markdown_row(
                [
                    record["launch"],
                    str(record["max_bs"]),
                    "**saved**",
                    cell((off["graph_state"] - on["graph_state"]) / MB if measured else None),
                    cell((off["captured"] - on["captured"]) / MB if measured else None),
                    cell((off["pool"] - on["pool"]) / MB if measured else None),
                    cell((off["held"] - on["held"]) / MB),
                    cell((off["meta"] - on["meta"]) / MB),
                ]
            )
        )
    print()


def measure_verify_logits(max_bs_list, monkeypatch) -> list[dict]:
    """Every arm's figures (bytes) per max bs and width of the verify logits memory."""
    import dataclasses

    from support import verify_logits_memory

    records = []
    for max_bs in max_bs_list:
        for label, case in verify_logits_memory.cases(max_bs, DEVICE).items():
            figures = verify_logits_memory.measure_case(case, DEVICE, monkeypatch)
            records.append(
                dict(
                    max_bs=max_bs,
                    width=label,
                    columns=case.vocab,
                    captured=list(case.captured),
                    figures={arm: dataclasses.asdict(f) for arm, f in figures.items()},
                    retained={
                        arm: figures[arm].captured - figures["off"].captured for arm in figures
                    },
                )
            )
    return records


def print_verify_logits(records: list[dict]) -> None:
    print("## Verify logits memory (EAGLE 3/1/4, GLM-5 LM head, target-verify exchange)\n")
    header = ["max bs", "width", "arm", "after capture (MB)", "graph pool (MB)", "peak (MB)"]
    print(markdown_header(header + ["retained beyond stock (MB)"]))
    for record in records:
        for arm, f in record["figures"].items():
            measured = f["pool"] is not None
            print(
                markdown_row(
                    [
                        str(record["max_bs"]),
                        f"{record['width']} ({record['columns']:,})",
                        arm,
                        cell(f["captured"] / MB if measured else None),
                        cell(f["pool"] / MB if measured else None),
                        cell(f["peak"] / MB if measured else None),
                        cell(record["retained"][arm] / MB if measured else None),
                    ]
                )
            )
    print()


def print_host(rows: list[dict], timed: bool, launch: str) -> None:
    print(f"## Host time of SGLang's init_forward_metadata_out_graph, EAGLE {launch}, seeded\n")
    print(markdown_header(["op", "bs", "plugin off us", "plugin on us", "on / off"]))
    for row in rows:
        print(
            markdown_row(
                [
                    row["op"],
                    str(row["bs"]),
                    cell(row["off_us"] if timed else None),
                    cell(row["on_us"] if timed else None),
                    cell(row["ratio"] if timed else None, "{:.2f}"),
                ]
            )
        )
    print()


def print_verify(records: list[dict], timed: bool) -> None:
    print("## Verify input (SGLang's build_eagle_verify_input)\n")
    header = ["EAGLE", "bs", "tree mask off (MB)", "tree mask on (MB)", "plugin off us"]
    header += ["plugin on us", "peak off (MB)", "peak on (MB)", "outputs"]
    print(markdown_header(header))
    for launch, row in records:
        print(
            markdown_row(
                [
                    launch,
                    str(row["bs"]),
                    cell(row["off_mask_bytes"] / MB, "{:,.2f}"),
                    cell(row["on_mask_bytes"] / MB, "{:,.4f}"),
                    cell(row["off_us"] if timed else None),
                    cell(row["on_us"] if timed else None),
                    cell(None if row["off_peak_bytes"] is None else row["off_peak_bytes"] / MB),
                    cell(None if row["on_peak_bytes"] is None else row["on_peak_bytes"] / MB),
                    "identical" if not row["differ"] else "differ: " + ", ".join(row["differ"]),
                ]
            )
        )
    print()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.rounds = DRY_RUN["rounds_per_server"] * 2 * len(args.launch)
        args.max_bs = DRY_RUN["max_bs"]
        args.memory_max_bs, args.host_calls = DRY_RUN["memory_max_bs"], DRY_RUN["host_calls"]
        args.verify_bs, args.verify_calls = DRY_RUN["verify_bs"], 1
        args.logits_max_bs = DRY_RUN["logits_max_bs"]
    elif DEVICE.type != "cuda":
        print("bench_dsa_serving_slice needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    import dataclasses

    import pytest
    import triton

    from support import dsa_serving, serving_loop
    from support.dsa_backends import LAUNCHES
    from support.sglang_import import sglang_version

    timed = not args.dry_run
    if timed:
        base = dsa_serving.GPU_SIZES
        sizes = dataclasses.replace(
            base, context=args.context, max_bs=args.max_bs, pool=2 * args.max_bs + 1
        )
        where = f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs"
    else:
        sizes = dsa_serving.cpu_sizes(args.max_bs)
        where = "the CPU (dry run: Triton's interpreter, graphs simulated, no figures)"
    print(
        f"# {where}; torch {torch.__version__}, triton {triton.__version__}, "
        f"SGLang {sglang_version()}\n"
    )
    record = dict(device=where, torch=torch.__version__, triton=triton.__version__)
    record.update(settings=vars(args))
    status = 0

    def progress(line):
        print(f"# {line}", file=sys.stderr, flush=True)

    with pytest.MonkeyPatch.context() as monkeypatch:
        dsa_serving.prepare(monkeypatch, DEVICE)
        dsa_serving.triton_tree_builder(monkeypatch)
        servers = tuple((name, seeded) for name in args.launch for seeded in (True, False))
        config = serving_loop.LoopConfig(
            sizes=sizes,
            rounds=args.rounds,
            servers=servers,
            seed=args.seed,
            # at least 10 indexer calls: the injected one within 10% of them
            indexer_every=max(1, min(20, args.rounds // 10)),
        )
        started = time.perf_counter()
        report = serving_loop.run(config, monkeypatch, progress=progress)
        progress(f"loop: {time.perf_counter() - started:.1f} s")
        print_loop(report, sizes)
        record["loop"] = report.to_json()
        status |= bool(report.failures())

        memory, host, verify = [], None, []
        for launch_name in args.memory_launch:
            for max_bs in args.memory_max_bs:
                measured = dataclasses.replace(sizes, max_bs=max_bs, pool=2 * max_bs + 1)
                with dsa_serving.launch(launch_name, measured) as (server_args, captured):
                    result = measure_memory(launch_name, measured, captured, server_args)
                    memory.append(
                        dict(launch=launch_name, max_bs=max_bs, figures=result["figures"])
                    )
                    steps = LAUNCHES[launch_name][0]
                    if max_bs == max(args.memory_max_bs):
                        rows = measure_verify_input(
                            result["arms"], steps, args.verify_bs, args.verify_calls, args.host_live
                        )
                        verify += [(launch_name, row) for row in rows]
                        status |= any(row["differ"] for row in rows)
                del result
                progress(f"memory and verify input: EAGLE {launch_name}, max bs {max_bs}")
        logits = measure_verify_logits(args.logits_max_bs, monkeypatch)
        progress("verify logits memory")
        with dsa_serving.launch(args.host_launch, sizes) as (_, captured):
            arms = build_pair(args.host_launch, sizes, captured)
            tokens = LAUNCHES[args.host_launch][2]
            host = measure_host_time(arms, captured, tokens, args.host_calls, args.host_live)
        progress("host time")
    print_host(host, timed, args.host_launch)
    print_memory(memory)
    print_verify(verify, timed)
    print_verify_logits(logits)
    record.update(host=host, memory=memory, verify=[dict(launch=n, **r) for n, r in verify])
    record.update(verify_logits=logits)
    if args.json:
        write_json(args.json, record)
    return status


if __name__ == "__main__":
    sys.exit(main())
