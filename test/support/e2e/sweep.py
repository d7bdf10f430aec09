"""The concurrency sweep: warm-up, SGLang's load client, and the report of the spec's speed tables.

Per server instance (``protocol.INSTANCE_ORDER``): the warm-up, then for each concurrency C
``protocol.RUNS_PER_INSTANCE`` runs of ``python -m sglang.benchmark.serving`` with the spec's
arguments (``bench_command``). SGLang's client runs as a subprocess, as in the spec; each run
appends one JSON line to ``<out>/<arm>-<instance>.jsonl`` (its ``--output-file``), tagged
``<arm>-<instance>`` (its ``--tag``).

The report, per concurrency point and arm, over the arm's runs at that point (n = 4 here):

- tok/s/user: each run's 1000 / ``median_tpot_ms`` (the median time per output token over the
  run's requests); the point shows the median over the runs.
- spread: (max - min) / median of the runs' tok/s/user.
- output tok/s, median TTFT, accept length: the median over the runs of ``output_throughput``,
  ``median_ttft_ms`` and ``accept_length`` (the server's average acceptance length, which the run's
  own ``--flush-cache`` resets after its warm-up request).
- gain: plugin tok/s/user / stock tok/s/user - 1.
- overlap: whether the two arms' [min, max] ranges of the runs' tok/s/user intersect.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from support.e2e.protocol import (
    ARMS,
    INSTANCE_ORDER,
    RUNS_PER_INSTANCE,
    Instance,
    parse_server_args,
    server_base_url,
)
from support.e2e.server import generate, serve_each_instance

WARMUP_INPUT_LEN = 1024
WARMUP_NEW_TOKENS = 48
# Warm-up token ids: ordinary tokens in any real vocabulary (30k tokens or more).
WARMUP_TOKEN_IDS = (1000, 30000)
INPUT_LEN = 1024
OUTPUT_LEN = 1024
SEED = 1


def num_prompts(concurrency: int) -> int:
    return max(concurrency * 6, 16)


def check_concurrencies(concurrencies: Sequence[int]) -> tuple[int, ...]:
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise ValueError(f"concurrencies must be positive integers, got {list(concurrencies)}")
    return tuple(concurrencies)


def warm_up(base_url: str, max_running_requests: int) -> None:
    """For every c in 1..max_running_requests, one ``/generate`` batch of c requests of
    WARMUP_INPUT_LEN token ids each and WARMUP_NEW_TOKENS new tokens (EOS ignored): SGLang's Triton
    kernels compile once per batch size, and this puts every compile before the measurements. The
    requests are all distinct, so none of them is served from the radix cache."""
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests must be at least 1, got {max_running_requests}")
    rng = random.Random(0)
    for c in range(1, max_running_requests + 1):
        batch = [
            [rng.randrange(*WARMUP_TOKEN_IDS) for _ in range(WARMUP_INPUT_LEN)] for _ in range(c)
        ]
        params = {"max_new_tokens": WARMUP_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        generate(base_url, {"input_ids": batch, "sampling_params": params})


def bench_command(
    base_url: str, concurrency: int, dataset_path: Path, output_file: Path, tag: str
) -> list[str]:
    """The spec's ``python -m sglang.benchmark.serving`` command for one run at ``concurrency``,
    plus where to send it, where to record it and the instance's tag."""
    return [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang", "--base-url", base_url,
        "--dataset-name", "random", "--dataset-path", str(dataset_path),
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--random-range-ratio", "1",
        "--num-prompts", str(num_prompts(concurrency)), "--max-concurrency", str(concurrency),
        "--seed", str(SEED), "--flush-cache", "--warmup-requests", "1",
        "--output-file", str(output_file), "--tag", tag,
    ]  # fmt: skip


def results_path(out_dir: Path, instance: Instance) -> Path:
    return out_dir / f"{instance.tag}.jsonl"


def run_instance(
    base_url: str,
    instance: Instance,
    concurrencies: Sequence[int],
    max_running_requests: int,
    dataset_path: Path,
    out_dir: Path,
) -> None:
    """One instance's share of the sweep against a running server: warm-up, then each concurrency
    RUNS_PER_INSTANCE times in a row."""
    concurrencies = check_concurrencies(concurrencies)
    output_file = results_path(out_dir, instance)
    if output_file.exists():
        raise ValueError(f"{output_file} exists; write to a new --out")
    warm_up(base_url, max_running_requests)
    for concurrency in concurrencies:
        for _ in range(RUNS_PER_INSTANCE):
            command = bench_command(base_url, concurrency, dataset_path, output_file, instance.tag)
            status = subprocess.run(command).returncode
            if status != 0:
                raise RuntimeError(
                    f"sglang.benchmark.serving exited with status {status} "
                    f"({instance.tag}, concurrency {concurrency})"
                )


def check_setup(
    server_args: Sequence[str], concurrencies: Sequence[int], dataset_path: Path
) -> argparse.Namespace:
    """The server arguments as SGLang reads them, once the sweep's inputs are checked."""
    parsed = parse_server_args(server_args)
    if parsed.max_running_requests is None:
        raise ValueError("the warm-up needs --max-running-requests in the server arguments")
    if not Path(dataset_path).is_file():
        raise ValueError(f"--dataset-path {dataset_path} is not a file (the ShareGPT JSON)")
    check_concurrencies(concurrencies)
    return parsed


def run_sweep(
    server_args: Sequence[str],
    concurrencies: Sequence[int],
    dataset_path: Path,
    out_dir: Path,
    startup_timeout_s: float,
) -> None:
    """The whole sweep: each instance of INSTANCE_ORDER launched with its arm's switches, its share
    run, and stopped; server logs go to ``<out>/<arm>-<instance>.server.log``."""
    parsed = check_setup(server_args, concurrencies, dataset_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    taken = [results_path(out_dir, i) for i in INSTANCE_ORDER if results_path(out_dir, i).exists()]
    if taken:
        raise ValueError(f"{', '.join(map(str, taken))} exist; write to a new --out")
    base_url = server_base_url(parsed)
    serve_each_instance(
        server_args,
        base_url,
        out_dir,
        startup_timeout_s,
        lambda instance: run_instance(
            base_url,
            instance,
            concurrencies,
            parsed.max_running_requests,
            dataset_path,
            out_dir,
        ),
    )


# ---------------------------------------------------------------------------------------------
# Report

_KEYS = (
    "tag",
    "max_concurrency",
    "completed",
    "median_tpot_ms",
    "median_ttft_ms",
    "output_throughput",
    "accept_length",
    "dataset_name",
    "random_input_len",
    "random_output_len",
    "random_range_ratio",
)


@dataclass(frozen=True)
class Run:
    """One recorded run of sglang.benchmark.serving."""

    instance: Instance
    concurrency: int
    tok_s_user: float
    output_tok_s: float
    median_ttft_ms: float
    accept_length: float | None
    workload: str


def run_from_record(record: dict, where: str) -> Run:
    """A Run from one JSON line of sglang.benchmark.serving's ``--output-file``."""
    missing = [key for key in _KEYS if key not in record]
    if missing:
        raise ValueError(f"{where}: not a sglang.benchmark.serving result, no {', '.join(missing)}")
    concurrency = record["max_concurrency"]
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"{where}: max_concurrency {concurrency!r} is not a positive integer")
    expected = num_prompts(concurrency)
    if record["completed"] != expected:
        raise ValueError(
            f"{where}: {record['completed']} of the protocol's {expected} requests completed "
            f"at concurrency {concurrency}"
        )
    tpot = record["median_tpot_ms"]
    if not isinstance(tpot, (int, float)) or not tpot > 0:
        raise ValueError(f"{where}: median_tpot_ms {record['median_tpot_ms']!r} is not positive")
    return Run(
        instance=Instance.from_tag(record["tag"]),
        concurrency=concurrency,
        tok_s_user=1000.0 / tpot,
        output_tok_s=record["output_throughput"],
        median_ttft_ms=record["median_ttft_ms"],
        accept_length=record["accept_length"],
        workload=(
            f"{record['dataset_name']} dataset, {record['random_input_len']} in / "
            f"{record['random_output_len']} out, range ratio {record['random_range_ratio']:g}"
        ),
    )


def load_runs(out_dir: Path) -> list[Run]:
    """Every run recorded in ``<out_dir>/*.jsonl``; all must share one workload."""
    paths = sorted(Path(out_dir).glob("*.jsonl"))
    if not paths:
        raise ValueError(f"no sglang.benchmark.serving results (*.jsonl) in {out_dir}")
    runs = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                runs.append(run_from_record(json.loads(line), f"{path}:{number}"))
    workloads = sorted({run.workload for run in runs})
    if len(workloads) > 1:
        raise ValueError(f"{out_dir} mixes workloads: {'; '.join(workloads)}")
    return runs


@dataclass(frozen=True)
class ArmPoint:
    """One arm's runs at one concurrency."""

    runs: tuple[Run, ...]

    @property
    def values(self) -> list[float]:
        return [run.tok_s_user for run in self.runs]

    @property
    def tok_s_user(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return (self.high - self.low) / self.tok_s_user

    @property
    def output_tok_s(self) -> float:
        return statistics.median(run.output_tok_s for run in self.runs)

    @property
    def median_ttft_ms(self) -> float:
        return statistics.median(run.median_ttft_ms for run in self.runs)

    @property
    def accept_length(self) -> float | None:
        lengths = [run.accept_length for run in self.runs]
        return None if None in lengths else statistics.median(lengths)


@dataclass(frozen=True)
class Point:
    concurrency: int
    stock: ArmPoint
    plugin: ArmPoint

    @property
    def gain(self) -> float:
        return self.plugin.tok_s_user / self.stock.tok_s_user - 1.0

    @property
    def overlap(self) -> bool:
        return self.stock.low <= self.plugin.high and self.plugin.low <= self.stock.high


def summarize(runs: Sequence[Run]) -> list[Point]:
    """One Point per concurrency, ascending. Every arm needs the same number of runs at every
    point, so that each point compares like with like."""
    grouped: dict[int, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        grouped[run.concurrency][run.instance.arm].append(run)
    counts = {(c, arm): len(grouped[c][arm]) for c in sorted(grouped) for arm in ARMS}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{arm} at {c}: {n}" for (c, arm), n in counts.items())
        raise ValueError(
            f"every arm needs the same number of runs at every concurrency ({listing})"
        )
    return [
        Point(c, ArmPoint(tuple(grouped[c]["stock"])), ArmPoint(tuple(grouped[c]["plugin"])))
        for c in sorted(grouped)
    ]


def _accept(point: Point) -> str:
    stock, plugin = point.stock.accept_length, point.plugin.accept_length
    if stock is None or plugin is None:
        return "-"
    stock_text, plugin_text = f"{stock:.2f}", f"{plugin:.2f}"
    return stock_text if stock_text == plugin_text else f"{stock_text} / {plugin_text}"


def markdown_table(points: Sequence[Point]) -> str:
    """The spec's speed-table columns, plus whether the arms' run ranges overlap."""
    lines = [
        "| concurrency | tok/s/user stock | plugin | gain | spread stock / plugin "
        "| output tok/s stock → plugin | median TTFT ms stock → plugin | accept length "
        "| ranges overlap |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for p in points:
        s, g = p.stock, p.plugin
        lines.append(
            f"| {p.concurrency} | {s.tok_s_user:.1f} | {g.tok_s_user:.1f} | {p.gain * 100:+.1f}% "
            f"| {s.spread * 100:.2f}% / {g.spread * 100:.2f}% "
            f"| {s.output_tok_s:.0f} → {g.output_tok_s:.0f} "
            f"| {s.median_ttft_ms:.0f} → {g.median_ttft_ms:.0f} | {_accept(p)} "
            f"| {'yes' if p.overlap else 'no'} |"
        )
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path, title: str) -> None:
    """tok/s/user against concurrency for both arms: the median, with bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    concurrencies = [p.concurrency for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, label in (("stock", "stock (switches 0)"), ("plugin", "plugin")):
        arm_points = [getattr(p, arm) for p in points]
        medians = [a.tok_s_user for a in arm_points]
        bars = [
            [m - a.low for m, a in zip(medians, arm_points)],
            [a.high - m for m, a in zip(medians, arm_points)],
        ]
        ax.errorbar(concurrencies, medians, yerr=bars, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tok/s/user (1000 / median TPOT)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: Path, title: str) -> str:
    """Writes ``<out_dir>/report.md`` and ``<out_dir>/tok_s_user.png``; returns the report."""
    runs = load_runs(out_dir)
    points = summarize(runs)
    n = len(points[0].stock.runs)
    text = "\n".join(
        [
            f"## {title}",
            "",
            f"{runs[0].workload}; n = {n} runs per arm per point. tok/s/user = 1000 / median TPOT; "
            "spread = (max - min) / median over the runs; values are medians over the runs.",
            "",
            markdown_table(points),
            "",
        ]
    )
    (Path(out_dir) / "report.md").write_text(text)
    plot(points, Path(out_dir) / "tok_s_user.png", title)
    return text
