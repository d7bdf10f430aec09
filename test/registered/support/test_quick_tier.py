"""The quick tier, ``python -m pytest test/registered -m quick``: every test module with tests that
run on the CPU has at least one of them marked ``quick``.

Read from each module's source: a test runs on the CPU unless it (or its module's ``pytestmark``) is
marked ``gpu`` or ``skip``, or carries a ``skipif`` other than ``skipif(torch.cuda.is_available(),
...)``; a module whose every test is a GPU test needs no quick one, nor do the modules of
:data:`NOT_QUICK`, whose every CPU test takes a minute or more on two cores.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SKIPPED_ONLY_ON_CUDA = "torch.cuda.is_available()"
# Module -> why none of its CPU tests is quick (each takes 1-3 minutes on two cores).
TP_GROUP = "its one CPU test starts a CPU (gloo) TP group of several processes"
NOT_QUICK = {
    "test/registered/unit/spec/test_draft_argmax_exchange_cpu_tp.py": TP_GROUP,
    "test/registered/unit/spec/test_draft_argmax_exchange_sglang_tp.py": TP_GROUP,
    "test/registered/unit/spec/test_verify_argmax_exchange_sglang_tp.py": TP_GROUP,
    "test/registered/kernels/benchmark/speculative/test_bench_verify_argmax_exchange.py": (
        "both CPU tests are dry runs of a whole benchmark, one of them in a CPU TP group"
    ),
    "test/registered/kernels/benchmark/attention/test_bench_dsa_serving_slice.py": (
        "its one CPU test is the benchmark's whole dry run, the serving loop at its least rounds"
    ),
}


def marks(node: ast.AST) -> list[ast.AST]:
    """Every ``pytest.mark.NAME``, or its call, in ``node`` (``pytest.param`` marks included)."""
    calls = {id(sub.func): sub for sub in ast.walk(node) if isinstance(sub, ast.Call)}
    return [calls.get(id(sub), sub) for sub in ast.walk(node) if is_mark(sub)]


def is_mark(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    )


def mark_name(mark: ast.AST) -> str:
    return (mark.func if isinstance(mark, ast.Call) else mark).attr


def runs_on_the_cpu(mark_nodes: list[ast.AST]) -> bool:
    for mark in mark_nodes:
        name = mark_name(mark)
        if name in ("gpu", "skip"):
            return False
        if name == "skipif":
            condition = mark.args[0] if isinstance(mark, ast.Call) and mark.args else None
            if condition is None or ast.unparse(condition) != SKIPPED_ONLY_ON_CUDA:
                return False
    return True


def marked_tests(source: str) -> list[tuple[str, list[ast.AST]]]:
    """(name, marks) of each test function, the module's ``pytestmark`` included in its marks."""
    tree = ast.parse(source)
    module_marks = [
        mark
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        for mark in marks(node.value)
    ]
    tests = []
    for node in tree.body:
        scopes = [(node, [])]
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            scopes = [(child, node.decorator_list) for child in node.body]
        for func, outer in scopes:
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and func.name.startswith(
                "test"
            ):
                decorators = [mark for d in [*outer, *func.decorator_list] for mark in marks(d)]
                tests.append((func.name, module_marks + decorators))
    return tests


def without_a_quick_test(source: str) -> bool:
    """Whether a module with this source has tests that run on the CPU and none of them quick."""
    on_cpu = [test_marks for _, test_marks in marked_tests(source) if runs_on_the_cpu(test_marks)]
    return bool(on_cpu) and not any(
        mark_name(mark) == "quick" for test_marks in on_cpu for mark in test_marks
    )


@pytest.mark.quick
def test_every_module_with_cpu_tests_has_a_quick_test():
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 40, "the test modules are found"
    names = {str(path.relative_to(TESTS.parent.parent)): path for path in modules}
    assert set(NOT_QUICK) <= set(names), "every module left out of the quick tier exists"
    missing = [
        name
        for name, path in names.items()
        if name not in NOT_QUICK and without_a_quick_test(path.read_text())
    ]
    assert missing == [], (
        "these modules have tests that run on the CPU and none marked @pytest.mark.quick (mark "
        "one that runs in seconds): " + ", ".join(missing)
    )
    quick_anyway = [name for name in NOT_QUICK if not without_a_quick_test(names[name].read_text())]
    assert quick_anyway == [], f"in NOT_QUICK but with a quick test: {', '.join(quick_anyway)}"


def module(*lines: str) -> str:
    return "\n".join(("import pytest", "", *lines, ""))


TEST_A = ("def test_a():", "    pass")
QUICK_AND_SLOW = ("@pytest.mark.quick", *TEST_A, "def test_b():", "    pass")
ON_CUDA = "@pytest.mark.skipif(torch.cuda.is_available(), reason='the CPU form')"
NOT_ON_CUDA = "@pytest.mark.skipif(not torch.cuda.is_available(), reason='a GPU')"
QUICK_PARAM = "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.quick), 2])"
METHOD = ("class TestA:", "    def test_a(self):", "        pass")


@pytest.mark.quick
@pytest.mark.parametrize(
    "source, lacks",
    [
        pytest.param(module(*QUICK_AND_SLOW), False, id="quick-and-slow"),
        pytest.param(module(*TEST_A, "def test_b():", "    pass"), True, id="none-quick"),
        pytest.param(module("@pytest.mark.gpu", *QUICK_AND_SLOW), True, id="quick-is-gpu"),
        pytest.param(module("pytestmark = pytest.mark.gpu", *TEST_A), False, id="gpu-module"),
        pytest.param(module("pytestmark = [pytest.mark.gpu]", *TEST_A), False, id="gpu-list"),
        pytest.param(module("@pytest.mark.gpu", *TEST_A), False, id="gpu-tests-only"),
        pytest.param(module("def helper():", "    pass"), False, id="no-tests"),
        pytest.param(module(QUICK_PARAM, "def test_a(x):", "    pass"), False, id="quick-param"),
        pytest.param(module("@pytest.mark.quick", ON_CUDA, *TEST_A), False, id="skip-on-cuda"),
        pytest.param(
            module("@pytest.mark.quick", NOT_ON_CUDA, *QUICK_AND_SLOW[1:]), True, id="skip-on-cpu"
        ),
        pytest.param(
            module(METHOD[0], "    @pytest.mark.quick", *METHOD[1:]), False, id="quick-method"
        ),
        pytest.param(module(*METHOD), True, id="slow-method"),
    ],
)
def test_a_module_lacks_a_quick_test_only_where_it_has_cpu_tests_and_none_quick(source, lacks):
    assert without_a_quick_test(source) == lacks
