"""The benchmarks' shared command-line helpers: defaults in the help, the ``--json`` record, and
the verdict of the fastest-arm column."""

import json

import pytest

from support.bench_cli import (
    MIXED_SHORT,
    SPEC_EPILOG,
    batch_lengths,
    benchmark_parser,
    fastest_verdict,
    measurements,
    sweep_points,
    write_json,
)

DOC = """Title line.

What it measures,
over two lines.

Usage, not in the help."""


@pytest.mark.quick
def test_the_help_shows_defaults_but_not_for_flags_or_options_without_one():
    parser = benchmark_parser(DOC)
    parser.add_argument("--bs", default="1,16", help="batch sizes")
    parser.add_argument("--zero", type=int, default=0, help="a zero default")
    parser.add_argument("--hot", action="store_true", help="a flag")
    parser.add_argument("--json", help="an output file")
    parser.add_argument("--tune", action="append", default=[], help="repeatable")
    parser.add_argument("--own", default="x", help="states it (default: all of them)")
    text = " ".join(parser.format_help().split())
    assert "batch sizes (default: 1,16)" in text
    assert "a zero default (default: 0)" in text
    assert "a flag (default" not in text and "an output file (default" not in text
    assert "repeatable (default" not in text
    assert "states it (default: all of them)" in text and "(default: x)" not in text


def test_the_description_is_the_first_two_paragraphs_and_the_epilog_names_the_spec():
    help_text = benchmark_parser(DOC).format_help()
    assert "Title line.\n\nWhat it measures,\nover two lines." in help_text
    assert "Usage, not in the help." not in help_text
    assert " ".join(SPEC_EPILOG.split()) in " ".join(help_text.split())


def test_the_json_record_holds_the_floors_the_settings_and_every_point(tmp_path):
    points = [{"op": "decode", "live": 1024, "bs": 1, "floor_us": 1.1, "ours": 2.0}]
    record = measurements(
        gpu="GPU", launch_floor_us=1.0, copy_bytes_per_us=4e6, l2="cold", points=points
    )
    write_json(str(tmp_path / "out.json"), record)
    assert json.loads((tmp_path / "out.json").read_text()) == {
        "gpu": "GPU",
        "launch_floor_us": 1.0,
        "copy_bytes_per_us": 4e6,
        "l2": "cold",
        "points": points,
    }


def test_a_mixed_point_follows_every_point_of_more_than_one_request():
    assert sweep_points(["decode"], [4096], [1, 4], mixed=True) == [
        ("decode", 4096, 1, False),
        ("decode", 4096, 4, False),
        ("decode", 4096, 4, True),
    ]
    assert sweep_points([3, 4], [1024], [4], mixed=False) == [
        (3, 1024, 4, False),
        (4, 1024, 4, False),
    ]


def test_a_mixed_batch_has_one_request_at_the_live_length_and_the_others_short():
    assert batch_lengths(65536, 3, mixed=False) == [65536] * 3
    assert batch_lengths(65536, 3, mixed=True) == [65536, MIXED_SHORT, MIXED_SHORT]


@pytest.mark.quick
def test_ours_is_fastest_no_slower_tied_within_one_percent_and_a_tenth_of_a_microsecond():
    assert fastest_verdict(34.0, [34.0, 50.0]) == "yes"
    assert fastest_verdict(34.44, [34.0, 50.0]) == "tie"  # 34.0 * 1.01 + 0.1
    assert fastest_verdict(34.5, [34.0, 50.0]) == "**NO**"
    assert fastest_verdict(1.1, [1.0]) == "tie"
    assert fastest_verdict(1.12, [1.0]) == "**NO**"
