"""The replay-metadata benchmark's plot, drawn on the CPU from a ``--json`` file.

``fixtures/replay-metadata-sweep.json`` has the shape ``--json`` writes for the sweep of the plot
(decode and target verify, live 1k to 1M, bs 1 and 16), with made-up numbers. The sweep that ships
with the docs (``docs/data/h200/replay-metadata-sweep.json``) is drawn as docs/results.md says.
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")

from support.scripts import load_script

HERE = Path(__file__).parent
SWEEP = HERE / "fixtures" / "replay-metadata-sweep.json"
SHIPPED_SWEEP = HERE.parents[4] / "docs" / "data" / "h200" / "replay-metadata-sweep.json"
FLOOR = "floor: launch gap + bytes / bandwidth"
bench = load_script(HERE / "bench_dsa_metadata_bounded.py")


@pytest.fixture
def sweep():
    return json.loads(SWEEP.read_text())


def curves(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_plot_from_a_json_file_writes_a_png_without_a_gpu(tmp_path, capsys):
    from matplotlib.image import imread

    out = tmp_path / "sweep.png"
    assert bench.main(["--plot-from", str(SWEEP), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(out).shape
    assert width > 1000 and height > 600
    assert capsys.readouterr().out == f"plot: {out}\n"


def test_the_shipped_sweep_draws_one_panel_per_op_and_batch_size():
    fig = bench.plot_sweep(json.loads(SHIPPED_SWEEP.read_text()))
    ops = ("decode", "target verify", "draft extend")
    assert [ax.get_title() for ax in fig.axes] == [
        f"{op}, bs {bs}" for op in ops for bs in (1, 4, 16, 32, 48)
    ]


def test_one_panel_per_op_and_batch_size_with_each_arm_against_the_live_length(sweep):
    fig = bench.plot_sweep(sweep)
    panels = [(op, bs) for op in ("decode", "verify") for bs in (1, 16)]
    assert [ax.get_title() for ax in fig.axes] == [
        f"{bench.OP_NAMES[op]}, bs {bs}" for op, bs in panels
    ]
    for ax, (op, bs) in zip(fig.axes, panels):
        points = sorted(
            (p for p in sweep["points"] if p["op"] == op and p["bs"] == bs), key=lambda p: p["live"]
        )
        lives = [p["live"] for p in points]
        assert lives == [1024, 4096, 16384, 65536, 262144, 1048576]
        lines = curves(ax)
        assert set(lines) == {*bench.PLOTTED.values(), FLOOR, "launch gap"}
        for key, label in bench.PLOTTED.items():
            assert list(lines[label].get_xdata()) == lives
            assert list(lines[label].get_ydata()) == [p[key] for p in points]
        assert list(lines[FLOOR].get_ydata()) == [p["floor_us"] for p in points]
        assert set(lines["launch gap"].get_ydata()) == {sweep["launch_floor_us"]}
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


@pytest.mark.quick
def test_an_arm_that_was_not_measured_is_left_out(sweep):
    for point in sweep["points"]:
        del point["sglang_kpool"]
    fig = bench.plot_sweep(sweep)
    assert set(curves(fig.axes[0])) == {"SGLang unbounded", "ours", FLOOR, "launch gap"}


def test_host_times_are_not_plotted(sweep):
    sweep["timing"] = "host"
    with pytest.raises(ValueError, match="--host"):
        bench.plot_sweep(sweep)


def test_plot_from_needs_an_output_file(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--plot-from", str(SWEEP)])
    assert done.value.code == 2
    assert "--plot FILE.png" in capsys.readouterr().err


def test_the_sweep_options_are_checked_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--ops", "decode,prefill"])
    assert done.value.code == 2
    assert "--ops" in capsys.readouterr().err
