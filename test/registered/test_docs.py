"""The repository speaks to its users: every file the docs cite is in the repository, no path of a
particular machine or name of a remote-execution setup, no fact that rests on a machine or a source
the reader cannot see ("the GPU machine", "the design review"), "the spec" says what it is, a plot
command names a data file that ships, the measured test count is stated once per page, the
SGLang wheel folder is ignored by git, and the figures of README's first paragraph and of spec.md's
status are the ones the data files under docs/data hold."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SKIPPED_DIRS = {".git", ".whl", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
FORBIDDEN = (
    "../shared",
    "shared/baselines",
    "/work/",
    "/root/",
    "device tool",
    "device kind",
    "device machine",
    "nvidia-h200",
    "carry `[",
    '"carry"',
)
# Sources and machines no reader can open or name: in every text file of the repository ...
UNSEEN_SOURCES = (
    "the GPU machine",
    "design review",
    "design notes",
    "user's report",
    "not available here",
)
# ... and, in the docs, the machine a sentence was written on.
UNSEEN_MACHINES = (
    "this machine",
    "that machine",
    "GPU machine",
    "no GPU here",
    "run here",
    "measured here",
    "available here",
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED_PATH = re.compile(r"`((?:python|test|docs|benchmark|\.ci)/[^`\s*]+)`")


def _checkout_files() -> list[Path]:
    """The files of the checkout: git's tracked and not-ignored ones where git knows the tree
    (so nothing a developer keeps in ignored folders counts), else every file under the root."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return [path for path in ROOT.rglob("*") if path.is_file()]
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def repo_files(*suffixes: str) -> list[Path]:
    return sorted(
        path
        for path in _checkout_files()
        if path.suffix in suffixes
        and not SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts[:-1])
        and not any(part.endswith(".egg-info") for part in path.parts)
    )


MARKDOWN = repo_files(".md")


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors of ``markdown``."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", markdown.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_docs_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in MARKDOWN}
    assert {"README.md", "docs/testing.md", "docs/spec.md", "docs/baselines.md"} <= names


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_in_the_repository(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_relative_to(ROOT.resolve()), f"{target} leaves the repository"
        assert resolved.exists(), f"{target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{target}: no heading #{anchor}"


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_path_the_docs_cite_exists(doc):
    for cited in CITED_PATH.findall(doc.read_text()):
        assert (ROOT / cited.rstrip("/.,:")).exists(), f"{doc.name} cites {cited}"


TEXT_FILES = [
    path
    for path in repo_files(".md", ".py", ".sh", ".toml", ".cfg", ".txt", ".yaml", ".json", ".log")
    if path.resolve() != Path(__file__).resolve()
]
# The docs a reader reads, without the recorded tool output under docs/data.
PAGES = [path for path in MARKDOWN if "data" not in path.relative_to(ROOT).parts[:-1]]


def _occurrences(paths, words, *, ignore_case=False):
    found = []
    for path in paths:
        text = path.read_text()
        text = text.lower() if ignore_case else text
        found += [
            f"{path.relative_to(ROOT)}: {word}"
            for word in words
            if (word.lower() if ignore_case else word) in text
        ]
    return found


@pytest.mark.quick
def test_no_machine_paths_or_remote_execution_names():
    """In docs, READMEs, scripts, docstrings, help text and the recorded tool output under
    docs/data (the repository's text files)."""
    assert _occurrences(TEXT_FILES, FORBIDDEN) == []


def test_no_fact_rests_on_a_source_or_machine_the_reader_cannot_see():
    """A fact says what it is and where it comes from (a command, a file of the repository, a place
    in SGLang's source), not "the design review" or "the GPU machine"; the docs do not speak from
    the machine they were written on ("this machine", "not available here")."""
    found = _occurrences(TEXT_FILES, UNSEEN_SOURCES, ignore_case=True)
    found += _occurrences(PAGES, UNSEEN_MACHINES, ignore_case=True)
    assert found == []


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_plot_command_draws_from_a_data_file_that_ships(doc):
    """``--plot-from FILE`` as a reader would paste it, from the top of the checkout; an upper-case
    name (``DATA.json``) is the option's placeholder in prose."""
    for name in re.findall(r"--plot-from\s+(?:\\\s+)?([^\s`]+)", doc.read_text()):
        if Path(name).stem.isupper():
            continue
        assert (ROOT / name).is_file(), f"{doc.name}: --plot-from {name} is not in the repository"


@pytest.mark.parametrize("doc", ["README.md", "docs/testing.md"])
def test_the_measured_test_count_is_stated_once(doc):
    """One sentence per page carries the measured CPU run, so that one edit updates it."""
    text = (ROOT / doc).read_text()
    assert len(re.findall(r"\b\d[\d,]* passed\b", text)) == 1
    assert not re.search(r"\b\d[\d,]* tests\b", text), "a second, unmeasured count"


@pytest.mark.parametrize(
    "doc",
    [path for path in MARKDOWN if path.name != "spec.md" and "data" not in path.parts],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_docs_that_speak_of_the_spec_link_to_what_it_is(doc):
    text = doc.read_text()
    if re.search(r"\bthe spec\b|\bthis PR\b", text, flags=re.I):
        assert re.search(r"\]\([./]*(docs/)?spec\.md\)", text), f"{doc.name} says 'the spec'"


def test_the_sglang_wheel_folder_is_ignored_by_git():
    assert ".whl/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_docs_speak_of_the_project_not_of_its_issues(doc):
    """No issue numbers: a reader of the repository has no issue tracker to look them up in."""
    assert not re.search(r"\bissues?[ -]?\d+|\bissue #\d+", doc.read_text(), flags=re.I)


# --- the quoted figures, read back from the data they were measured into -------------------------

DATA = ROOT / "docs" / "data" / "h200"
# The replay-metadata sweep's op names, as the docs write them.
SWEEP_OPS = {"decode": "decode", "target-verify": "verify", "draft-extend": "draft_extend"}
ONE_LAUNCH = "one launch"  # the MTP table's column of the form that ships
STOCK_MTP_ARMS = ("stock", "stock foreach")


def _points(name: str) -> list[dict]:
    return json.loads((DATA / name).read_text())["points"]


def _point(points: list[dict], **key) -> dict:
    (found,) = [p for p in points if all(p[k] == v for k, v in key.items())]
    return found


def _quoted(pattern: str, text: str, doc: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in ``text``, a space in ``pattern`` matching any line break."""
    found = re.search(pattern.replace(" ", r"\s+"), text, flags=re.S)
    assert found, f"{doc}: no sentence matches {pattern!r}"
    return found.groups()


def _us(value: float) -> str:
    return f"{value:.1f}"


def _readme_headline() -> tuple[str, int, int]:
    """README's first paragraph (the text between the title and the first section), and the batch
    size and live length its figures are quoted at."""
    text = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    bs, live_k = _quoted(r"bs (\d+) and (\d+)k live tokens per request", text, "README.md")
    return text, int(bs), int(live_k) * 1024


def test_the_readme_headline_quotes_the_replay_metadata_sweep():
    """The target-verify point of README's headline, against both of SGLang's kernels at
    ``index_kpool`` 1, is the sweep's point at that batch size and live length."""
    text, bs, live = _readme_headline()
    (op,) = _quoted(r"the (target-verify) replay metadata \(", text, "README.md")
    point = _point(
        _points("replay-metadata-sweep.json"),
        op=SWEEP_OPS[op],
        live=live,
        bs=bs,
        mixed=False,
    )
    quoted = _quoted(
        r"replay metadata \([^)]*\) takes ([\d.]+) us per step.*?against ([\d.]+) us for SGLang's"
        r" KPool kernels.*?and ([\d.]+) us for the unbounded kernels",
        text,
        "README.md",
    )
    assert quoted == (_us(point["ours"]), _us(point["sglang_kpool"]), _us(point["sglang"]))


def test_the_readme_headline_quotes_the_mtp_draft_decode_sweep():
    """The MTP point of README's headline is the one launch against the faster stock arm."""
    text, bs, live = _readme_headline()
    steps, ours, stock = _quoted(
        r"into the (\d) draft-step backends[^.]*?takes ([\d.]+) us against ([\d.]+) us",
        text,
        "README.md",
    )
    point = _point(
        _points("mtp-draft-decode-metadata.json"),
        steps=int(steps),
        live=live,
        bs=bs,
        mixed=False,
    )
    assert (ours, stock) == (
        _us(point[ONE_LAUNCH]),
        _us(min(point[arm] for arm in STOCK_MTP_ARMS)),
    )


def test_spec_md_states_the_sweep_as_it_stands():
    """spec.md's status of the balanced grid: how many of the sweep's points ours wins against both
    SGLang arms, and how much slower the others are than the faster arm, SGLang's KPool kernels."""
    text = (ROOT / "docs" / "spec.md").read_text()
    points = _points("replay-metadata-sweep.json")
    lost = [p for p in points if p["ours"] >= min(p["sglang"], p["sglang_kpool"])]
    won, total = _quoted(
        r"faster than both SGLang arms at (\d+) of the (\d+) points of the sweep",
        text,
        "docs/spec.md",
    )
    assert (int(won), int(total)) == (len(points) - len(lost), len(points))
    if not lost:
        return
    others, slower = _quoted(
        r"points of the sweep.*?the other (\d+) are heavy decode points, (.*?) slower than SGLang's"
        r" KPool kernels",
        text,
        "docs/spec.md",
    )
    assert int(others) == len(lost)
    assert all(p["op"] == "decode" and not p["mixed"] for p in lost), "not all heavy decode"
    assert all(p["sglang_kpool"] <= p["sglang"] for p in lost), "not the KPool arm"
    percents = sorted(100 * (p["ours"] / p["sglang_kpool"] - 1) for p in lost)
    assert re.findall(r"([\d.]+)%", slower) == [f"{pct:.1f}" for pct in percents]
