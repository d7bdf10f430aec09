"""The concurrency sweep: warm-up, SGLang's load client against a stand-in, and the report."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.sglang_import import require_sglang

require_sglang()

from support.e2e import sweep  # noqa: E402
from support.e2e.protocol import Instance  # noqa: E402

RECORDED = (
    Path(__file__).parent / "fixtures" / "sweep"
)  # 2 points x 2 arms x 4 runs, in sglang.benchmark.serving's format


def test_each_point_sends_six_prompts_per_concurrency_slot_and_at_least_16():
    assert [sweep.num_prompts(c) for c in (1, 2, 3, 16, 32)] == [16, 16, 18, 96, 192]


def test_each_run_is_the_spec_load_client_command_recorded_under_the_instance_tag():
    command = sweep.bench_command(
        "http://h:1", 8, Path("sg.json"), Path("out/plugin-2.jsonl"), "plugin-2"
    )
    assert command == [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang", "--base-url", "http://h:1",
        "--dataset-name", "random", "--dataset-path", "sg.json",
        "--random-input-len", "1024", "--random-output-len", "1024", "--random-range-ratio", "1",
        "--num-prompts", "48", "--max-concurrency", "8", "--seed", "1",
        "--flush-cache", "--warmup-requests", "1",
        "--output-file", "out/plugin-2.jsonl", "--tag", "plugin-2",
    ]  # fmt: skip


def test_warm_up_sends_c_concurrent_distinct_1k_token_requests_with_48_new_tokens_for_each_c(
    standin,
):
    server = standin(max_requests=3)
    sweep.warm_up(server.base_url, max_running_requests=3)
    assert [len(p["input_ids"]) for p in server.payloads] == [1, 2, 3]
    sequences = [tuple(ids) for p in server.payloads for ids in p["input_ids"]]
    assert {len(ids) for ids in sequences} == {1024} and len(set(sequences)) == 6
    for payload in server.payloads:
        assert payload["sampling_params"] == {
            "max_new_tokens": 48,
            "temperature": 0.0,
            "ignore_eos": True,
        }


@pytest.fixture
def word_tokenizer(tmp_path):
    """A local word-level tokenizer, so that SGLang's load client needs no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "how do i sort a list in python use sorted tok".split()
    tokenizer = Tokenizer(
        models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, "[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer"
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_sglang_load_client_runs_against_a_stand_in_and_its_result_reads_as_a_run(
    standin, word_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    turns = [
        {"from": "human", "value": "how do i sort a list"},
        {"from": "gpt", "value": "use sorted"},
    ]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": turns}] * 20))
    # SGLang's load client imports SGLang first: on a loaded 2-core machine that alone can pass the
    # stand-in's default 30 s lifetime, so this one lives until the test stops it.
    server = standin(model_path=str(word_tokenizer), max_requests=17, lifetime_s=600)
    output = tmp_path / "stock-1.jsonl"
    command = sweep.bench_command(server.base_url, 1, sharegpt, output, "stock-1")
    subprocess.run(command, check=True, capture_output=True)

    assert len(server.payloads) == 17 and server.flushes == 1  # its warm-up request, then 16
    measured = server.payloads[1:]
    assert [p["sampling_params"]["max_new_tokens"] for p in measured] == [1024] * 16
    (run,) = sweep.load_runs(tmp_path)
    assert (run.instance, run.concurrency, run.accept_length) == (Instance("stock", 1), 1, 3.25)
    assert run.workload == "random dataset, 1024 in / 1024 out, range ratio 1"
    assert run.tok_s_user > 0


@pytest.mark.quick
def test_report_takes_medians_over_the_runs_of_each_arm_and_point():
    points = sweep.summarize(sweep.load_runs(RECORDED))
    # Concurrency 1, tok/s/user per run: stock 500 500 400 400, plugin 625 625 500 500.
    # Concurrency 2: stock 250 250 250 200, plugin 320 x 4.
    assert sweep.markdown_table(points).splitlines()[2:] == [
        "| 1 | 450.0 | 562.5 | +25.0% | 22.22% / 22.22% | 471 → 476 | 73 → 74 | 4.56 | yes |",
        "| 2 | 250.0 | 320.0 | +28.0% | 20.00% / 0.00% | 750 → 753 | 76 → 76 | 4.54 / 4.50 | no |",
    ]


def test_report_is_written_as_markdown_and_a_plot(tmp_path):
    shutil.copytree(RECORDED, tmp_path, dirs_exist_ok=True)
    text = sweep.write_report(tmp_path, "Concurrency sweep, test")
    assert text.startswith("## Concurrency sweep, test\n")
    assert "random dataset, 1024 in / 1024 out, range ratio 1; n = 4 runs per arm per point" in text
    assert (tmp_path / "report.md").read_text() == text
    assert (tmp_path / "tok_s_user.png").read_bytes().startswith(b"\x89PNG")


def _recorded_lines():
    return [json.loads(line) for path in sorted(RECORDED.glob("*.jsonl")) for line in path.open()]


def _write(tmp_path, records):
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_that_lost_requests_is_an_error(tmp_path):
    records = _recorded_lines()
    records[3]["completed"] = 15
    _write(tmp_path, records)
    with pytest.raises(
        ValueError, match="runs.jsonl:4: 15 of the protocol's 16 requests completed"
    ):
        sweep.load_runs(tmp_path)


def test_a_file_that_is_not_a_load_client_result_is_an_error(tmp_path):
    records = _recorded_lines()
    del records[0]["median_tpot_ms"], records[0]["accept_length"]
    _write(tmp_path, records)
    with pytest.raises(
        ValueError, match="not a sglang.benchmark.serving result, no median_tpot_ms, accept_length"
    ):
        sweep.load_runs(tmp_path)


def test_runs_of_different_workloads_are_not_mixed(tmp_path):
    records = _recorded_lines()
    records[0]["random_output_len"] = 512
    _write(tmp_path, records)
    with pytest.raises(ValueError, match="mixes workloads"):
        sweep.load_runs(tmp_path)


def test_every_arm_needs_the_same_number_of_runs_at_every_point():
    runs = [
        r
        for r in sweep.load_runs(RECORDED)
        if r.instance != Instance("plugin", 2) or r.concurrency != 2
    ]
    with pytest.raises(ValueError, match="same number of runs .*plugin at 2: 2"):
        sweep.summarize(runs)


def test_an_empty_results_folder_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no sglang.benchmark.serving results"):
        sweep.write_report(tmp_path, "t")


def test_sweep_inputs_are_checked_before_any_server_starts(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text("[]")
    with pytest.raises(ValueError, match="the warm-up needs --max-running-requests"):
        sweep.check_setup(["--model-path", "m"], [1], dataset)
    args = ["--model-path", "m", "--max-running-requests", "4"]
    with pytest.raises(ValueError, match="is not a file"):
        sweep.check_setup(args, [1], tmp_path / "missing.json")
    with pytest.raises(ValueError, match="positive integers"):
        sweep.check_setup(args, [0, 4], dataset)
    assert sweep.check_setup(args, [1, 4], dataset).max_running_requests == 4


def test_an_instance_never_appends_to_earlier_results(tmp_path, standin):
    server = standin(max_requests=0)
    (tmp_path / "stock-1.jsonl").write_text("")
    with pytest.raises(ValueError, match="stock-1.jsonl exists; write to a new --out"):
        sweep.run_instance(server.base_url, Instance("stock", 1), [1], 4, Path("sg.json"), tmp_path)
