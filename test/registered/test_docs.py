"""The repository speaks to its users: every file the docs cite is in the repository, no path of a
particular machine or name of a remote-execution setup, no fact that rests on a machine or a source
the reader cannot see ("the GPU machine", "the design review"), "the spec" says what it is, a plot
command names a data file that ships, the test counts are stated once (docs/testing.md) and are
what pytest collects, the SGLang wheel folder is ignored by git; every figure or condition the docs
repeat (``FACTS``) equals its source (a constant of the code, a point of the data under docs/data,
the page that states a measurement) on every page, README's headline figures are the results.md
rows they link to, results.md names the GPU of the data it cites, and spec.md's status is the one
the sweep's data holds."""

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
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


# The one sentence of docs/testing.md that states the suite's size: all tests, then the GPU ones.
COLLECTED = r"The suite collects (\d[\d,]*) tests \([^)]*\), (\d[\d,]*) of them GPU tests"


@pytest.fixture(scope="module")
def collected() -> dict[str, int]:
    """What pytest collects under test/registered: every test and those marked ``gpu``, from one
    collection (``-m gpu`` deselects the others and the summary counts both)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "test/registered", "--collect-only", "-q", "-m", "gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    counts = re.search(r"^(\d+)/(\d+) tests collected", done.stdout, flags=re.M)
    assert done.returncode == 0 and counts, done.stdout[-2000:] + done.stderr[-2000:]
    return {"tests": int(counts[2]), "gpu": int(counts[1])}


def test_the_test_counts_are_stated_once_and_are_what_pytest_collects(collected):
    """One sentence of docs/testing.md states the suite's size, so that one edit updates it, and it
    is the size pytest collects now (a count of an older tree, or a pass count that does not add
    up to it, fails); README states no count of its own and links to that page."""
    testing = (ROOT / "docs" / "testing.md").read_text()
    for passed, skipped in re.findall(r"(\d[\d,]*) passed, (\d[\d,]*) skipped", testing):
        run = int(passed.replace(",", "")) + int(skipped.replace(",", ""))
        assert run == collected["tests"], (
            f"docs/testing.md: {passed} passed + {skipped} skipped = {run} tests, "
            f"pytest collects {collected['tests']}"
        )
    tests, gpu = _quoted(COLLECTED, testing, "docs/testing.md")
    stated = {"tests": int(tests.replace(",", "")), "gpu": int(gpu.replace(",", ""))}
    assert stated == collected, f"docs/testing.md states {stated}, pytest collects {collected}"
    counts = re.findall(r"\b\d[\d,]* (?:tests|passed|skipped)\b", testing)
    assert counts == [f"{tests} tests"], f"docs/testing.md states other counts: {counts}"
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\b\d[\d,]* (?:passed|tests)\b", readme), "README restates a count"
    assert "](docs/testing.md)" in readme


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
PACKAGE = ROOT / "python" / "sglang_dsa_mtp"
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


def _constant(module: str, name: str):
    """The literal value the package module ``module`` (a path under python/sglang_dsa_mtp) assigns
    to ``name`` at its top level (``NAME = 4``, or ``A, NAME = 16, 8``), read without importing it.
    """
    import ast

    tree = ast.parse((PACKAGE / module).read_text())
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], ast.literal_eval(node.value)
        if isinstance(target, ast.Name) and target.id == name:
            return value
        if isinstance(target, ast.Tuple):
            names = [getattr(element, "id", None) for element in target.elts]
            if name in names:
                return value[names.index(name)]
    raise AssertionError(f"python/sglang_dsa_mtp/{module} assigns no {name}")


def _replay_point(bs: int, live: int, op: str = "verify") -> dict:
    return _point(_points("replay-metadata-sweep.json"), op=op, live=live, bs=bs, mixed=False)


def _mtp_point(steps: int, bs: int, live: int) -> dict:
    return _point(
        _points("mtp-draft-decode-metadata.json"), steps=steps, live=live, bs=bs, mixed=False
    )


def _verify_mask_mb(bs: int) -> str:
    """The verify tree mask SGLang's EAGLE worker allocates per round at EAGLE 4/1/5 and a 1M
    context, as the serving slice measured it (decimal MB)."""
    slice_ = json.loads((DATA / "serving-slice.json").read_text())
    (row,) = [r for r in slice_["verify"] if r["launch"] == "4/1/5" and r["bs"] == bs]
    return f"{row['off_mask_bytes'] / 1e6:.0f}"


@dataclass(frozen=True)
class Fact:
    """A figure or condition the docs may state on several pages: ``truth()`` gives its fields as
    the docs write them, from where it is decided (a constant of the code, a point of the data
    under docs/data, the one page that states a measurement); each pattern finds one way a page
    words it, its groups being the fields named beside it, on every page or on the one page named
    third (a table row whose wording other pages' tables share). Whitespace in a pattern matches
    any run of whitespace, line breaks included."""

    name: str
    source: str
    truth: Callable[[], dict[str, str]]
    patterns: tuple[tuple[str, tuple[str, ...]] | tuple[str, tuple[str, ...], str], ...]


def _code_fact(name: str, module: str, constant: str, *patterns: str) -> Fact:
    """A fact whose truth is one constant of the plugin's ``module``, the one group of each of
    ``patterns`` (its field ``columns``)."""
    return Fact(
        name,
        f"{constant} in python/sglang_dsa_mtp/{module}",
        lambda: {"columns": str(_constant(module, constant))},
        tuple((pattern, ("columns",)) for pattern in patterns),
    )


# The row of README's headline table, up to its figure cell.
_ROW = r"^\| {what}[^|\n]*\| "
FACTS = (
    _code_fact(
        "the argmax exchange's split width",
        "kernels/ops/speculative/draft_argmax_partials.py",
        "SPLIT_N",
        r"lanes per (\d[\d,]*) (?:vocab )?columns",
        r"per (\d[\d,]*) columns: 4 (?:exact )?fp32 lanes",
        r"`SPLIT_N` = (\d[\d,]*)",
        r"candidates per (\d[\d,]*)-column split",
        r"one program per (\d[\d,]*) columns of a row",
        r"reads the split's (\d[\d,]*) columns",
    ),
    _code_fact(
        "the replay-metadata kernels' tile width",
        "kernels/ops/attention/dsa_metadata_common.py",
        "TILE_N",
        r"`TILE_N` = (\d+)",
        r"`TILE_N=(\d+)`",
    ),
    Fact(
        "the replay-metadata kernels' default budget",
        "PROGRAMS_PER_SM in python/sglang_dsa_mtp/kernels/ops/host.py, H200_SMS in devices.py",
        lambda: {
            "per_sm": str(_constant("kernels/ops/host.py", "PROGRAMS_PER_SM")),
            "h200": str(
                _constant("kernels/ops/host.py", "PROGRAMS_PER_SM")
                * _constant("devices.py", "H200_SMS")
            ),
        },
        (
            (
                r"`budget` defaults to (\d+) programs per SM \((\d+) on an H200\)",
                ("per_sm", "h200"),
            ),
            (r"(\d+) programs per SM share the batch's live tiles", ("per_sm",)),
            (r"budget shared by all the batch's live tiles \((\d+) programs per SM\)", ("per_sm",)),
            (r"A budget of (\d+) \((\d+) programs per SM\)", ("h200", "per_sm")),
        ),
    ),
    Fact(
        "where the decode and draft-extend launches grow",
        "DECODE_MANY_* and DRAFT_EXTEND_MANY_* in kernels/ops/attention/dsa_metadata_bounded.py",
        lambda: {
            "decode_bs": str(
                _constant("kernels/ops/attention/dsa_metadata_bounded.py", "DECODE_MANY_REQUESTS")
            ),
            "decode_per_sm": str(
                _constant(
                    "kernels/ops/attention/dsa_metadata_bounded.py", "DECODE_MANY_PROGRAMS_PER_SM"
                )
            ),
            "extend_bs": str(
                _constant(
                    "kernels/ops/attention/dsa_metadata_bounded.py", "DRAFT_EXTEND_MANY_REQUESTS"
                )
            ),
            "extend_warps": str(
                _constant(
                    "kernels/ops/attention/dsa_metadata_bounded.py", "DRAFT_EXTEND_MANY_WARPS"
                )
            ),
        },
        (
            (
                r"(\d+) programs per SM for decode from (\d+) requests",
                ("decode_per_sm", "decode_bs"),
            ),
            (
                r"decode replay of (\d+) requests or more to (\d+) per SM",
                ("decode_bs", "decode_per_sm"),
            ),
            (r"(\d+) warps for draft extend from (\d+)\b", ("extend_warps", "extend_bs")),
            (
                r"draft extend of (\d+) requests or more launches with (\d+) warps",
                ("extend_bs", "extend_warps"),
            ),
            (r"draft extend from (\d+) requests runs (\d+) warps", ("extend_bs", "extend_warps")),
        ),
    ),
    Fact(
        "the target-verify replay metadata at bs 16, 1k live, 1M-token table",
        "docs/data/h200/replay-metadata-sweep.json",
        lambda: {
            "ours": _us(_replay_point(16, 1024)["ours"]),
            "kpool": _us(_replay_point(16, 1024)["sglang_kpool"]),
            "unbounded": _us(_replay_point(16, 1024)["sglang"]),
        },
        (
            (
                _ROW.format(what="target-verify replay metadata, bs 16, 1k live")
                + r"([\d.]+) -> ([\d.]+) us",
                ("kpool", "ours"),
            ),
            (r"target-verify replay metadata ([\d.]+) us at bs 16, 1k live", ("ours",)),
            (
                r"^\| target verify \| 1k \|[^|\n]*\|[^|\n]*\| ([\d.]+) -> ([\d.]+) \|",
                ("kpool", "ours"),
                "docs/results.md",
            ),
            (
                r"^\| 16 \| ([\d.]+) -> ([\d.]+) \| [\d.]+ -> [\d.]+ \| [\d.]+ -> [\d.]+ \|",
                ("unbounded", "ours"),
                "docs/e2e.md",
            ),
        ),
    ),
    Fact(
        "the MTP draft-decode metadata into 3 step backends at bs 16, 1k live",
        "docs/data/h200/mtp-draft-decode-metadata.json (the faster stock arm, the one launch)",
        lambda: {
            "ours": _us(_mtp_point(3, 16, 1024)[ONE_LAUNCH]),
            "stock": _us(min(_mtp_point(3, 16, 1024)[arm] for arm in STOCK_MTP_ARMS)),
        },
        (
            (
                _ROW.format(what="MTP draft-decode metadata, 3 step backends, bs 16, 1k live")
                + r"([\d.]+) -> ([\d.]+) us",
                ("stock", "ours"),
            ),
            (
                r"^\| 3 \(EAGLE 4/1/5\) \| 1k \|[^|\n]*\|[^|\n]*\| ([\d.]+) -> ([\d.]+) \|",
                ("stock", "ours"),
                "docs/results.md",
            ),
            (
                r"^\| 16 \| [\d.]+ -> [\d.]+ \| [\d.]+ -> [\d.]+ \| ([\d.]+) -> ([\d.]+) \|",
                ("stock", "ours"),
                "docs/e2e.md",
            ),
        ),
    ),
    Fact(
        "the verify tree mask SGLang allocates per round (EAGLE 4/1/5, 1M context)",
        "docs/data/h200/serving-slice.json (verify: off_mask_bytes)",
        lambda: {"bs16": _verify_mask_mb(16), "bs48": _verify_mask_mb(48)},
        (
            (r"\((\d+) MB at bs 16, (\d+) MB at bs 48 with EAGLE 4/1/5", ("bs16", "bs48")),
            (r"tree mask[^.]*?\((\d+) MB at bs 48", ("bs48",)),
        ),
    ),
)


def _mentions(fact: Fact, page: Path) -> list[tuple[str, dict[str, str]]]:
    """Each place ``page`` states ``fact``: the matched words and the fields they state."""
    found, text, name = [], page.read_text(), page.relative_to(ROOT).as_posix()
    for pattern, fields, *only in fact.patterns:
        if only and only[0] != name:
            continue
        regex = re.compile(pattern.replace(" ", r"\s+"), flags=re.M)
        for match in regex.finditer(text):
            stated = {field: value.replace(",", "") for field, value in zip(fields, match.groups())}
            found.append((" ".join(match.group(0).split()), stated))
    return found


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_figure_a_page_repeats_equals_its_source(doc):
    """Every mention of each fact of ``FACTS`` on the page states what its source holds."""
    wrong = []
    for fact in FACTS:
        truth = fact.truth()
        for words, stated in _mentions(fact, doc):
            expected = {field: truth[field].replace(",", "") for field in stated}
            if stated != expected:
                wrong.append(
                    f"{fact.name}: {words!r} states {stated}, {fact.source} holds {expected}"
                )
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("fact", FACTS, ids=lambda fact: fact.name)
def test_each_fact_is_stated_somewhere(fact):
    """A fact whose patterns find no page has lost its wording (or its page): its patterns would
    then check nothing."""
    assert any(_mentions(fact, page) for page in PAGES), f"no page states {fact.name}"


# --- README's headline table: each figure is the results.md row it links to ----------------------


def _section(markdown: Path, anchor: str) -> str:
    """The text under the heading of ``markdown`` whose anchor is ``anchor``, to the next heading
    of the same or a higher level."""
    lines = markdown.read_text().splitlines()
    for i, line in enumerate(lines):
        heading = re.match(r"^(#+)\s+(.*?)\s*$", line)
        if heading and re.sub(r"[^\w\- ]", "", heading[2].lower()).replace(" ", "-") == anchor:
            level, body = len(heading[1]), []
            for rest in lines[i + 1 :]:
                deeper = re.match(r"^(#+)\s", rest)
                if deeper and len(deeper[1]) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"{markdown.name}: no heading #{anchor}")


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables of ``text``: each its header's cells and its rows' cells."""
    tables = []
    for block in re.findall(r"^\|[^\n]*\n\|[-:| ]+\|\n(?:\|[^\n]*\n?)*", text, flags=re.M):
        header, _, *rows = block.strip("\n").splitlines()
        tables.append((_cells(header), [_cells(row) for row in rows]))
    return tables


HEADLINE_COLUMN = "results.md row; column"
HEADLINE_LINK = re.compile(r"\[([^\];]+)(?:; ([^\]]+))?\]\(docs/results\.md#([\w-]+)\)")


def test_readme_headline_figures_are_the_rows_they_link_to():
    """README's headline table (its last column: ``HEADLINE_COLUMN``): each row a figure pair ``A -> B unit``
    (SGLang -> the plugin) and a link ``[row; column]`` to results.md: the row's first cells
    (comma separated) and, where the pair is not one ``A -> B`` cell of that row, the one or two
    columns (``&`` between) that hold A and B. The pair must be that cell, or those two cells, of the
    row of the first table under the linked heading whose header has those columns and that has the
    row."""
    headline = [t for t in _tables((ROOT / "README.md").read_text()) if t[0][-1] == HEADLINE_COLUMN]
    assert (
        len(headline) == 1
    ), f"README.md has {len(headline)} tables whose last column is {HEADLINE_COLUMN!r}"
    ((_, rows),) = headline
    assert len(rows) >= 3, "README's headline table has fewer than three rows"
    for what, figures, source in rows:
        pair = re.fullmatch(r"([\d.,]+) -> ([\d.,]+) (?:us|MB|GB)", figures)
        assert pair, f"README headline {what!r}: {figures!r} is not 'A -> B unit'"
        link = HEADLINE_LINK.fullmatch(source)
        assert (
            link
        ), f"README headline {what!r}: {source!r} is not '[row; column](docs/results.md#...)'"
        key, columns = link[1].split(", "), link[2].split(" & ") if link[2] else []
        section = _section(ROOT / "docs" / "results.md", link[3])
        found = [
            (cells, row)
            for cells, table in _tables(section)
            if all(column in cells for column in columns)
            for row in table
            if row[: len(key)] == key
        ]
        where = f"README headline {what!r}: row {key} {columns} under results.md#{link[3]}"
        assert found, f"{where}: no such row"
        cells, row = found[0]  # the first table under the heading that has the row
        a, b = pair[1], pair[2]
        if len(columns) == 2:
            stated = (row[cells.index(columns[0])], row[cells.index(columns[1])])
            assert stated == (a, b), f"{where} holds {stated}, README says {a} -> {b}"
        elif columns:
            stated = row[cells.index(columns[0])]
            assert stated == f"{a} -> {b}", f"{where} holds {stated!r}, README says {a} -> {b}"
        else:
            assert f"{a} -> {b}" in row, f"{where} holds no cell {a} -> {b}: {row}"


# --- results.md names the GPU of the data it cites ------------------------------------------------

RESULTS = ROOT / "docs" / "results.md"
# The GPU kinds with a data folder (docs/data/h200 -> H200), as the docs name them.
GPU_KINDS = sorted(
    path.name.upper() for path in (ROOT / "docs" / "data").iterdir() if path.is_dir()
)
GPU_NAME = re.compile(r"\b(" + "|".join(GPU_KINDS) + r")s?\b")
GPU_DATA = re.compile(r"\bdata/(" + "|".join(kind.lower() for kind in GPU_KINDS) + r")/")


def _results_sections() -> list[str]:
    """results.md cut at every heading, each piece its heading line and the text under it."""
    parts = re.split(r"^(?=#+\s)", RESULTS.read_text(), flags=re.M)
    return [part for part in parts if part.strip()]


@pytest.mark.quick
def test_results_md_title_and_intro_name_every_gpu_its_data_comes_from():
    """The title and the paragraphs before the first section name each GPU kind whose data the page
    cites (a title "on H200" over sections measured on an H100 fails)."""
    title, *_ = _results_sections()
    cited = {kind.upper() for kind in GPU_DATA.findall(RESULTS.read_text())}
    assert cited, "results.md cites no data under docs/data/<gpu>/"
    assert set(GPU_NAME.findall(title.splitlines()[0])) == cited, "the title's GPUs"
    assert set(GPU_NAME.findall(title)) == cited, "the introduction's GPUs"


@pytest.mark.quick
def test_each_results_md_section_names_the_gpu_of_the_data_it_cites():
    """A section (heading and text, to the next heading) that cites data under docs/data/<gpu>/
    names that GPU, and the GPU it names first is the one of the first data it cites: its heading
    or opening lines cannot name another GPU than the one its data was measured on."""
    wrong = []
    for section in _results_sections():
        heading = section.splitlines()[0]
        cited = [kind.upper() for kind in GPU_DATA.findall(section)]
        named = GPU_NAME.findall(section)
        if not cited:
            continue
        if not named or named[0] != cited[0]:
            first = f"data/{cited[0].lower()}/"
            wrong.append(f"{heading}: names {named[:1]} first, cites {first} first")
        wrong += [
            f"{heading}: cites data/{kind.lower()}/, never names {kind}"
            for kind in sorted(set(cited) - set(named))
        ]
    assert wrong == [], "\n".join(wrong)


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
