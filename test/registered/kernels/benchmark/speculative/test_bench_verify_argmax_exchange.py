"""The target-verify exchange's two benchmarks check their arms in a dry run, on the CPU (CI): the
one-GPU script (LM head + SGLang's cast and argmax against LM head + partials + finalize) and the
script through SGLang's TP group (a two-process gloo group; where SGLang is installed)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.scripts import load_script
from support.sglang_import import require_sglang

HERE = Path(__file__).parent


def table_rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_the_one_gpu_benchmark_checks_its_arms_in_a_dry_run(capsys):
    bench = load_script(HERE / "bench_verify_argmax_exchange.py")
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tokens equal in every row" in out
    rows = table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("4/1/5", "1", "5"),
        ("4/1/5", "4", "20"),
        ("5/1/6", "1", "6"),
        ("5/1/6", "4", "24"),
    ]
    # vocab 1001 at TP 2: 512-column shards, one split each; 5 rows
    assert rows[0][-3] == f"{5 * 1001 * 2 / 2 / 1e6:.1f} / {5 * 2 * 1 * 16 / 1e3:.1f}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_the_sglang_tp_benchmark_checks_its_arms_in_a_cpu_dry_run():
    """Run as users run it, a script: its ranks are spawned processes, which import its body by the
    script's name."""
    require_sglang()
    done = subprocess.run(
        [sys.executable, str(HERE / "bench_verify_argmax_exchange_sglang.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the exchange engages" in done.stdout
    assert [(r[0], r[1]) for r in table_rows(done.stdout)] == [("1", "5"), ("3", "15")]
