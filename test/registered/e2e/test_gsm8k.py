"""GSM8K through /generate: SGLang's few-shot prompts and answer extraction, run order, report."""

import json

import pytest

from support.sglang_import import require_sglang

require_sglang()

from support.e2e import gsm8k  # noqa: E402
from support.e2e.protocol import Instance  # noqa: E402

# Eight questions: the first five are also the shots. The stand-in answers question 6 and 7 wrong.
QUESTIONS = [(f"What is {i} + {i}?", f"{i} and {i} make {2 * i}.\n#### {2 * i}") for i in range(8)]
SHOTS = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in QUESTIONS[:5])


@pytest.fixture
def data_path(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    return path


def _answer(prompt: str) -> str:
    """Four words each: right for questions 0-5, no number for 6 and 7."""
    question = prompt.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
    i = [q for q, _ in QUESTIONS].index(question)
    return f"So it is {2 * i}." if i < 6 else "I cannot tell you."


@pytest.mark.quick
def test_prompts_are_five_shots_then_the_question_and_labels_the_final_number(data_path):
    questions = gsm8k.load_questions(data_path)
    assert questions.prompts[7] == SHOTS + "Question: What is 7 + 7?\nAnswer:"
    assert questions.labels == tuple(2 * i for i in range(8))


def test_a_run_flushes_the_cache_sends_its_first_question_alone_then_the_rest(standin, data_path):
    server = standin(answer=_answer, max_requests=8)
    questions = gsm8k.load_questions(data_path)
    record = gsm8k.run_ordering(server.base_url, questions, "reverse", parallel=4, tag="plugin-1")

    assert server.flushes == 1
    assert server.payloads[0]["text"] == questions.prompts[7]
    assert sorted(p["text"] for p in server.payloads) == sorted(questions.prompts)
    for payload in server.payloads:
        assert payload["sampling_params"] == {
            "max_new_tokens": 512,
            "temperature": 0.0,
            "stop": ["Question", "Assistant:", "<|separator|>"],
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
        }
    assert {key: record[key] for key in ("correct", "invalid", "num_questions")} == {
        "correct": 6,
        "invalid": 2,
        "num_questions": 8,
    }
    # Four completion tokens per answer, one verify step per two tokens (the stand-in's counts).
    assert (record["completion_tokens"], record["spec_verify_ct"]) == (32, 16)
    assert record["predictions"] == [0, 2, 4, 6, 8, 10, -9999999, -9999999]


def test_both_orderings_of_each_instance_make_the_report(standin, data_path, tmp_path):
    server = standin(answer=_answer, max_requests=32)
    questions = gsm8k.load_questions(data_path)
    out = tmp_path / "out"
    out.mkdir()
    for instance in (Instance("stock", 1), Instance("plugin", 1)):
        gsm8k.run_instance(server.base_url, instance, questions, parallel=4, out_dir=out)
    assert sorted(p.name for p in out.glob("*.json")) == [
        "plugin-1-forward.json",
        "plugin-1-reverse.json",
        "stock-1-forward.json",
        "stock-1-reverse.json",
    ]
    text = gsm8k.write_report(out, "GSM8K, test")
    assert text.splitlines()[6:] == [
        "| stock | 75.00% | 2.000 | 25.00% | stock-1 forward 75.00%, stock-1 reverse 75.00% |",
        "| plugin | 75.00% | 2.000 | 25.00% | plugin-1 forward 75.00%, plugin-1 reverse 75.00% |",
    ]
    with pytest.raises(ValueError, match="stock-1-forward.json exists; write to a new --out"):
        gsm8k.run_instance(server.base_url, Instance("stock", 1), questions, 4, out)


def _save_run(folder, tag, **fields):
    run = {"tag": tag, "ordering": "forward", "num_questions": 2, "correct": 1, "invalid": 0}
    run |= {"completion_tokens": 9, "spec_verify_ct": 0, **fields}
    (folder / f"{tag}-forward.json").write_text(json.dumps(run))


def test_without_speculative_decoding_the_accept_length_is_a_dash(tmp_path):
    _save_run(tmp_path, "stock-1")
    _save_run(tmp_path, "plugin-1")
    assert "| stock | 50.00% | - | 0.00% |" in gsm8k.write_report(tmp_path, "t")


def test_a_report_needs_runs_of_both_arms(tmp_path):
    _save_run(tmp_path, "stock-1")
    with pytest.raises(ValueError, match="no GSM8K runs of arm plugin"):
        gsm8k.write_report(tmp_path, "t")


def test_a_report_refuses_files_that_are_not_runs_of_the_kit(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"tag": "stock-1", "accuracy": 0.9}))
    with pytest.raises(ValueError, match="other.json: not a GSM8K run of this kit, no ordering"):
        gsm8k.write_report(tmp_path, "t")


@pytest.mark.parametrize(
    "lines, message",
    [
        (None, "is not a file; download the GSM8K test set from https://raw.githubusercontent"),
        ([{"question": "q"}], "line 1 has no 'question' and 'answer'"),
        ([{"question": "q", "answer": "#### 1"}] * 5, "5 questions; 5 shots need more"),
        (
            [{"question": "q", "answer": "#### 1"}] * 6 + [{"question": "q", "answer": "none"}],
            r"line\(s\) \[7\]",
        ),
    ],
)
def test_a_bad_data_file_is_an_error(tmp_path, lines, message):
    path = tmp_path / "test.jsonl"
    if lines is not None:
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=message):
        gsm8k.load_questions(path)


def test_orderings_are_file_order_and_reverse():
    assert gsm8k.ordering("forward", 3) == [0, 1, 2]
    assert gsm8k.ordering("reverse", 3) == [2, 1, 0]
    with pytest.raises(ValueError, match="unknown ordering 'random'"):
        gsm8k.ordering("random", 3)
