"""The pick benchmark checks its arms in a dry run, on the CPU (CI): the partials module as it ships
and a baseline copy loaded from a file, at the draft's and the target verify's call sites."""

from pathlib import Path

import pytest

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support.scripts import load_script

HERE = Path(__file__).parent


def test_the_pick_benchmark_checks_both_arms_at_both_call_sites_in_a_dry_run(capsys):
    bench = load_script(HERE / "bench_argmax_pick.py")
    assert bench.main(["--dry-run", "--baseline", dap.__file__]) == 0
    out = capsys.readouterr().out
    assert "tokens as expected in every row" in out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0].split("|")[5:7] == [" ours ", " baseline "]
    points = [tuple(cell.strip() for cell in line.strip("|").split("|")[:4]) for line in lines[1:]]
    assert points == [
        ("draft decode", "1", "3008", "1"),
        ("draft decode", "1", "3008", "4"),
        ("draft decode", "2", "1504", "1"),
        ("draft decode", "2", "1504", "4"),
        ("target verify", "1", "3008", "5"),
        ("target verify", "2", "1504", "5"),
    ]


@pytest.mark.quick
def test_the_token_check_fails_on_a_wrong_pick(capsys, monkeypatch):
    bench = load_script(HERE / "bench_argmax_pick.py")
    monkeypatch.setattr(bench, "DRY_RUN", dict(vocab=300, tp=[1], draft_rows=[2], verify_rows=[]))
    monkeypatch.setattr(bench, "expected_tokens", lambda logits, *_: logits[:, 0].long() * 0 + 1)
    assert bench.main(["--dry-run"]) == 1
    assert "TOKENS DIFFER" in capsys.readouterr().out
