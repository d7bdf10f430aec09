"""The serving-slice benchmark's dry run, on the CPU: its serving loop passes (one launch, seeded and
unseeded), and it prints and writes every table: host time, memory beside the meta-device
computation, the verify input with both arms' outputs identical."""

import json
from pathlib import Path

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from support.sglang_import import require_sglang

require_sglang()

from support.scripts import load_script

bench = load_script(Path(__file__).parent / "bench_dsa_serving_slice.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run is the CPU form")
def test_the_dry_run_passes_the_loop_and_prints_every_table(
    fresh_switches, sglang_targets_restored, capsys, tmp_path
):
    record = tmp_path / "slice.json"
    argv = ["--dry-run", "--launch", "4/1/5", "--memory-launch", "4/1/5", "--json", str(record)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "Loop: PASSED" in out
    for title in ("## Host time", "## Graph state memory", "## Verify input"):
        assert title in out
    assert "| 4/1/5 | 3 | plugin off |" in out and "| 4/1/5 | 3 | **saved** |" in out
    written = json.loads(record.read_text())
    assert written["loop"]["failures"] == []
    assert written["loop"]["replays"] == 3 * 40
    assert {row["op"] for row in written["host"]} == {
        "target verify",
        "draft extend",
        "draft decode",
    }
    assert [(m["launch"], m["max_bs"]) for m in written["memory"]] == [("4/1/5", 2), ("4/1/5", 3)]
    for measured in written["memory"]:
        for arm in measured["figures"].values():
            assert arm["held"] == arm["meta"], "the device's graph state is the meta computation's"
    assert [row["differ"] for row in written["verify"]] == [[], []]
