"""The replay-metadata benchmark's ``--host`` table, as a dry run on the CPU: every arm of every op
(the MTP one launch too) is called once, and the table and the ``--json`` record carry the host floor
measured in the same run (``host_floor_us``: once before the table, and at every point as one more
arm)."""

import json
from pathlib import Path

import pytest
import torch

from support.scripts import load_script

HERE = Path(__file__).parent
bench = load_script(HERE / "bench_dsa_metadata_bounded.py")
OPS = ("decode", "verify", "draft_extend", "draft_decode")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a dry run is the CPU form")
def test_the_host_dry_run_calls_every_arm_and_records_the_host_floor(tmp_path, capsys):
    record_path = tmp_path / "host.json"
    argv = ["--host", "--dry-run", "--live", "256", "--bs", "1,2", "--ops", ",".join(OPS)]
    assert bench.main([*argv, "--steps", "2", "--json", str(record_path)]) == 0
    record = json.loads(record_path.read_text())
    assert record["timing"] == "host" and record["host_floor_us"] > 0
    assert [(p["op"], p["bs"]) for p in record["points"]] == [
        (op, bs) for op in OPS for bs in (1, 2)
    ]
    for point in record["points"]:
        arms = {"sglang", "ours"} | (
            {"sglang precompute"} if point["op"] == "draft_decode" else set()
        )
        arms.add("host_floor_us")
        assert arms <= set(point) and all(point[arm] > 0 for arm in arms)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| op |"))
    assert header.endswith("| ours - sglang | one launch | ours / one launch |")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(OPS) * 2
    for row, point in zip(rows, record["points"]):
        cells = row.strip("| ").split(" | ")
        assert cells[-2] == f"{point['host_floor_us']:.1f}"
        assert cells[-1] == f"{point['ours'] / point['host_floor_us']:.2f}"


@pytest.mark.quick
def test_a_dry_run_is_of_the_host_table_only(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--dry-run"])
    assert done.value.code == 2
    assert "--host" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form: plans with a stub launcher")
def test_the_host_profile_times_every_part_of_every_op_through_a_plan(capsys):
    profile = load_script(HERE / "profile_replay_metadata_host.py")
    assert profile.main(["--bs", "1,2", "--calls", "3", "--rounds", "1", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    assert header.split(" | ")[2:-1] == ["call", "wrapper", *profile.PARTS]
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [(row[0].strip("| "), row[1]) for row in rows] == [
        (op, bs) for op in profile.OPS for bs in ("1", "2")
    ]
    assert all(float(cell) > 0 for row in rows for cell in row[2:-1])
