"""GSM8K accuracy of both arms: the test set, 5-shot, greedy, 512 new tokens, through ``/generate``.

Prompts and answer extraction are ``sglang.test.few_shot_gsm8k``'s own functions: the shots are the
first 5 questions of the file with their answers, each prompt is the shots followed by
"Question: ...\\nAnswer:", and the predicted value is the last number of the answer. The request
carries the sampling parameters that harness sends through SGLang's frontend: its stop strings, the
frontend's special-token defaults, greedy, 512 new tokens.

A run asks every question once, in one of two orderings (file order, reverse order): it empties the
radix cache, sends the ordering's first question alone, and only then the rest, ``parallel`` at a
time. So the 5-shot prefix KV is computed by one request on its own, identically in both arms, and
every other question reads it from the radix cache. Each instance of ``protocol.INSTANCE_ORDER``
runs both orderings: 2 orderings x 2 instances per arm. A run is saved as
``<out>/<arm>-<instance>-<ordering>.json``.

Accept length: the run's completion tokens over its target verify steps, summed over its requests
(``completion_tokens`` and ``spec_verify_ct`` of each answer's ``meta_info``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sglang.test.few_shot_gsm8k import (
    INVALID,
    get_answer_value,
    get_few_shot_examples,
    get_one_example,
)
from sglang.utils import read_jsonl

from support.e2e.protocol import (
    ARMS,
    Instance,
    parse_server_args,
    server_base_url,
)
from support.e2e.server import flush_cache, generate, serve_each_instance

DATA_URL = (
    "https://raw.githubusercontent.com/openai/grade-school-math/master/"
    "grade_school_math/data/test.jsonl"
)
NUM_SHOTS = 5
MAX_NEW_TOKENS = 512
# The stop strings of sglang.test.few_shot_gsm8k.run_eval's program (not importable: local there).
STOP = ["Question", "Assistant:", "<|separator|>"]
ORDERINGS = ("forward", "reverse")


@dataclass(frozen=True)
class Questions:
    prompts: tuple[str, ...]
    labels: tuple[int, ...]


def load_questions(path: Path) -> Questions:
    """Prompts and reference answers of a GSM8K JSONL file, built as sglang.test.few_shot_gsm8k
    builds them."""
    if not Path(path).is_file():
        raise ValueError(f"{path} is not a file; download the GSM8K test set from {DATA_URL}")
    lines = list(read_jsonl(str(path)))
    for number, line in enumerate(lines, 1):
        if not isinstance(line, dict) or not {"question", "answer"} <= line.keys():
            raise ValueError(f"{path}: line {number} has no 'question' and 'answer'")
    if len(lines) <= NUM_SHOTS:
        raise ValueError(f"{path}: {len(lines)} questions; {NUM_SHOTS} shots need more")
    shots = get_few_shot_examples(lines, NUM_SHOTS)
    labels = tuple(get_answer_value(line["answer"]) for line in lines)
    bad = [number for number, label in enumerate(labels, 1) if label == INVALID]
    if bad:
        raise ValueError(f"{path}: no numeric answer on line(s) {bad[:10]}")
    prompts = tuple(shots + get_one_example(lines, i, False) for i in range(len(lines)))
    return Questions(prompts, labels)


def ordering(name: str, count: int) -> list[int]:
    if name not in ORDERINGS:
        raise ValueError(f"unknown ordering {name!r}; the orderings are {', '.join(ORDERINGS)}")
    forward = list(range(count))
    return forward if name == "forward" else forward[::-1]


def request(prompt: str) -> dict:
    """The ``/generate`` request for one question."""
    return {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "stop": STOP,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
        },
    }


def run_ordering(
    base_url: str, questions: Questions, ordering_name: str, parallel: int, tag: str
) -> dict:
    """One run: every question once, in ``ordering_name``; returns the run's record."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    order = ordering(ordering_name, len(questions.prompts))
    flush_cache(base_url)

    def ask(index: int) -> dict:
        return generate(base_url, request(questions.prompts[index]))

    answers = {order[0]: ask(order[0])}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        answers.update(zip(order[1:], pool.map(ask, order[1:])))
    predictions = [get_answer_value(answers[i]["text"]) for i in range(len(order))]
    metas = [answers[i]["meta_info"] for i in range(len(order))]
    return {
        "tag": tag,
        "ordering": ordering_name,
        "num_questions": len(order),
        "correct": sum(p == label for p, label in zip(predictions, questions.labels)),
        "invalid": sum(p == INVALID for p in predictions),
        "completion_tokens": sum(meta["completion_tokens"] for meta in metas),
        "spec_verify_ct": sum(meta.get("spec_verify_ct", 0) for meta in metas),
        "predictions": predictions,
    }


def run_path(out_dir: Path, instance: Instance, ordering_name: str) -> Path:
    return Path(out_dir) / f"{instance.tag}-{ordering_name}.json"


def run_instance(
    base_url: str, instance: Instance, questions: Questions, parallel: int, out_dir: Path
) -> None:
    """One instance's share against a running server: both orderings, each saved."""
    paths = {name: run_path(out_dir, instance, name) for name in ORDERINGS}
    for path in paths.values():
        if path.exists():
            raise ValueError(f"{path} exists; write to a new --out")
    for ordering_name, path in paths.items():
        record = run_ordering(base_url, questions, ordering_name, parallel, instance.tag)
        path.write_text(json.dumps(record) + "\n")


def run_accuracy(
    server_args: Sequence[str],
    data_path: Path,
    out_dir: Path,
    parallel: int,
    startup_timeout_s: float,
) -> None:
    """Every instance of INSTANCE_ORDER launched with its arm's switches, its share run, stopped."""
    parsed = parse_server_args(server_args)
    questions = load_questions(data_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    if list(out_dir.glob("*.json")):
        raise ValueError(f"{out_dir} already holds runs; write to a new --out")
    base_url = server_base_url(parsed)
    serve_each_instance(
        server_args,
        base_url,
        out_dir,
        startup_timeout_s,
        lambda instance: run_instance(base_url, instance, questions, parallel, out_dir),
    )


# ---------------------------------------------------------------------------------------------
# Report

_KEYS = (
    "tag",
    "ordering",
    "num_questions",
    "correct",
    "invalid",
    "completion_tokens",
    "spec_verify_ct",
)


def load_records(out_dir: Path) -> list[dict]:
    paths = sorted(Path(out_dir).glob("*.json"))
    if not paths:
        raise ValueError(f"no GSM8K runs (*.json) in {out_dir}")
    records = []
    for path in paths:
        record = json.loads(path.read_text())
        missing = [key for key in _KEYS if key not in record]
        if missing:
            raise ValueError(f"{path}: not a GSM8K run of this kit, no {', '.join(missing)}")
        Instance.from_tag(record["tag"])
        records.append(record)
    if len({record["num_questions"] for record in records}) > 1:
        raise ValueError(f"{out_dir} mixes runs over different numbers of questions")
    return records


@dataclass(frozen=True)
class ArmAccuracy:
    arm: str
    records: tuple[dict, ...]

    def _total(self, key: str) -> int:
        return sum(record[key] for record in self.records)

    @property
    def accuracy(self) -> float:
        return self._total("correct") / self._total("num_questions")

    @property
    def invalid(self) -> float:
        return self._total("invalid") / self._total("num_questions")

    @property
    def accept_length(self) -> float | None:
        verify = self._total("spec_verify_ct")
        return self._total("completion_tokens") / verify if verify else None


def summarize(records: Sequence[dict]) -> list[ArmAccuracy]:
    by_arm = {arm: [r for r in records if Instance.from_tag(r["tag"]).arm == arm] for arm in ARMS}
    empty = [arm for arm, runs in by_arm.items() if not runs]
    if empty:
        raise ValueError(f"no GSM8K runs of arm {', '.join(empty)}")
    return [ArmAccuracy(arm, tuple(runs)) for arm, runs in by_arm.items()]


def markdown_table(arms: Sequence[ArmAccuracy]) -> str:
    lines = [
        "| arm | accuracy | accept length | invalid | runs |",
        "|---|---:|---:|---:|---|",
    ]
    for arm in arms:
        accept = "-" if arm.accept_length is None else f"{arm.accept_length:.3f}"
        runs = ", ".join(
            f"{r['tag']} {r['ordering']} {r['correct'] / r['num_questions'] * 100:.2f}%"
            for r in arm.records
        )
        lines.append(
            f"| {arm.arm} | {arm.accuracy * 100:.2f}% | {accept} | {arm.invalid * 100:.2f}% "
            f"| {runs} |"
        )
    return "\n".join(lines)


def write_report(out_dir: Path, title: str) -> str:
    """Writes ``<out_dir>/report.md``; returns the report."""
    records = load_records(out_dir)
    text = "\n".join(
        [
            f"## {title}",
            "",
            f"GSM8K, {records[0]['num_questions']} questions, {NUM_SHOTS}-shot, greedy, "
            f"{MAX_NEW_TOKENS} new tokens; accuracy over all runs of an arm.",
            "",
            markdown_table(summarize(records)),
            "",
        ]
    )
    (Path(out_dir) / "report.md").write_text(text)
    return text
