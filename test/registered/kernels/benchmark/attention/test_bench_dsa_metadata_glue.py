"""The metadata-glue benchmark's dry run, on the CPU: it builds the three arms and SGLang's own glue
route, prints and writes every table (the prep per op and live batch size, per EAGLE round, the glue
captures, the memory)."""

import json
from pathlib import Path

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from support.sglang_import import require_sglang

require_sglang()

from support.scripts import load_script

bench = load_script(Path(__file__).parent / "bench_dsa_metadata_glue.py")


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run is the CPU form")
def test_the_dry_run_prints_every_table(fresh_switches, sglang_targets_restored, capsys, tmp_path):
    record = tmp_path / "glue.json"
    assert bench.main(["--dry-run", "--json", str(record)]) == 0
    out = capsys.readouterr().out
    for title in ("## Replay prep per runner", "## Per EAGLE round", "## Glue capture per key"):
        assert title in out
    assert "## Memory after capture" in out
    written = json.loads(record.read_text())
    assert {(row["op"], row["raw_bs"]) for row in written["prep"]} == {
        (op, bs)
        for op in ("target verify", "draft extend", "draft decode")
        for bs in bench.DRY_RUN["bs"]
    }
    verify = [row for row in written["prep"] if row["op"] == "target verify"]
    assert all(row["sglang_glue_captured"] for row in verify)  # SGLang's own route replayed it
    assert all(row["sglang_glue_host_us"] > 0 for row in verify)
    # every call of the glued arm through its glue graphs
    for op, counts in written["served"].items():
        assert counts["routed"] > 0 and not counts["eager"], (op, counts)
    assert sorted(written["captures"]) == ["draft decode", "draft extend v2", "target verify"]
    # the Python around every glue graph, its launch a no-op, in the prep's place
    assert "## Warm: the Python around the glue graph" in out
    for row in written["prep"]:
        for label in ("noop", "python_glued", "python_glue_replay", "least"):
            assert row[f"{label}_in_place_host_us"] > 0, (row["op"], row["raw_bs"], label)
        assert f"| {row['op']} | {row['raw_bs']} | {row['bs']} | " in out
    assert all(len(keys) == 2 for keys in written["captures"].values())  # SGLang's list: 1, 2


profile = load_script(Path(__file__).parent / "profile_glue_route_host.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the profile is the CPU's")
def test_the_route_profile_times_every_runner_through_its_glue(
    fresh_switches, sglang_targets_restored, capsys
):
    assert profile.main(["--max-bs", "2", "--calls", "20", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for op in ("target verify", "draft extend", "draft decode"):
        assert (
            f"| plugin's glue | {op} | 2 | 2 |" in out
            and f"| plugin's glue | {op} | 2 | 1 |" in out
        )
    assert "| SGLang's route | target verify | 2 | 2 |" in out and "MetadataGlueGraph" in out
