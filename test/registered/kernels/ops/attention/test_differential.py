"""Differential tests: every replay-metadata kernel against SGLang 0.5.23's own, compiled, on seeded
random cases (``test/support/differential.py``), whole poisoned buffers, at every budget.

Triton's interpreter does not compile a kernel, so it cannot see a fault of the compiled code: these
run on a CUDA GPU (``bash test/run_gpu.sh``), once for each Triton the plugin runs with. Each case
(decode; target verify; draft extend with static, per-request and all-zero extend lengths; the
first three and per-request draft extend again with padded CUDA-graph rows; the MTP one launch into
1 to 4 step backends) is run at budgets 1, rows - 1, rows, 3 x rows + 1, the default and above it
against SGLang's kernel on identically poisoned buffers, every element compared; a failure names
the case's facts, the budget and the buffers that differ. On the CPU, the cases themselves are
checked, and one small case of each form runs through the interpreter.
"""

import pytest
import torch

from support.constants import WIDTH_1M
from support.differential import (
    FORMS,
    FORMS_PADDED,
    POOL_ROWS,
    budgets,
    edge_lengths,
    random_case,
    written_rows,
)
from support.metadata_cases import run_draft_decode_multi

SEEDS = range(32)
PADDED_SEEDS = range(100, 116)
MTP_SEEDS = range(200, 212)


def describe(case) -> str:
    lengths = case.seq_lens.tolist()
    facts = (
        f"{case.op} bs {case.bs} width {case.width} page {case.page_size} "
        f"page_table_1 {case.with_page_table_1} next_n {case.next_n} "
        f"req_to_token stride {case.req_to_token.stride(0)}"
    )
    if case.op == "draft_extend":
        facts += f" extend {case.extend_seq_lens.tolist()} static {case.static_extend_len}"
    return f"{facts} lengths {lengths[:12]}{' ...' if len(lengths) > 12 else ''}"


def differing(expected: dict, actual: dict) -> list[str]:
    return [
        name
        for name, tensor in expected.items()
        if tensor is not None and not torch.equal(tensor, actual[name])
    ]


def outputs(case) -> dict:
    """The case's poisoned buffers; with no draft-extend rows SGLang copies ``seq_lens`` whole into
    ``cache_seqlens``, which is then exactly bs long, as the backend's per-bs buffers are."""
    out = case.outputs()
    if case.op == "draft_extend" and case.total_len == 0:
        out["cache_seqlens"] = out["cache_seqlens"][: case.bs]
    return out


def mismatches(case) -> list[str]:
    """Our kernel at every budget against SGLang's, each on its own poisoned buffers."""
    expected = case.run("sglang", outputs(case))
    found = []
    for budget in budgets(case):
        names = differing(expected, case.run("bounded", outputs(case), budget=budget))
        if names:
            found.append(f"budget {budget}: {', '.join(names)} differ")
    return found


def one_launch_mismatches(case, steps: int) -> list[str]:
    """The one launch into ``steps`` destinations at every budget against SGLang's decode kernel."""
    expected = case.run("sglang", outputs(case))
    found = []
    for budget in budgets(case):
        outs = run_draft_decode_multi(case, [outputs(case) for _ in range(steps)], budget=budget)
        for i, out in enumerate(outs):
            names = differing(expected, out)
            if names:
                found.append(f"budget {budget}, destinations[{i}]: {', '.join(names)} differ")
    return found


@pytest.fixture(scope="module")
def pool_1m():
    """Random token indices in ``POOL_ROWS`` request slots of SGLang's default 1M-token width."""
    gen = torch.Generator().manual_seed(2026)
    table = torch.randint(0, 1 << 30, (POOL_ROWS, WIDTH_1M), dtype=torch.int32, generator=gen)
    return table.to("cuda")


# ------------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", FORMS)
def test_bounded_kernels_match_sglang_on_random_cases(form, seed, pool_1m):
    case = random_case(form, seed, pool_1m)
    found = mismatches(case)
    assert not found, f"{describe(case)}: " + "; ".join(found)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", PADDED_SEEDS)
@pytest.mark.parametrize("form", FORMS_PADDED)
def test_bounded_kernels_match_sglang_with_padded_graph_rows(form, seed, pool_1m):
    case = random_case(form, seed, pool_1m, padded=True)
    found = mismatches(case)
    assert not found, f"{describe(case)}: " + "; ".join(found)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", MTP_SEEDS)
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_one_launch_matches_sglang_decode_in_every_step_backend(steps, seed, pool_1m):
    case = random_case("decode", seed, pool_1m, padded=seed % 2 == 1)
    found = one_launch_mismatches(case, steps)
    assert not found, f"{steps} step backends, {describe(case)}: " + "; ".join(found)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_bounded_kernels_match_sglang_at_bs_0(form, pool_1m):
    case = random_case(form, 0, pool_1m)
    case.seq_lens, case.req_pool_indices = case.seq_lens[:0], case.req_pool_indices[:0]
    if case.op == "draft_extend":
        case.extend_seq_lens, case.total_len = case.extend_seq_lens[:0], 0
    found = mismatches(case)
    assert not found, f"{describe(case)}: " + "; ".join(found)


# ------------------------------------------------------------------------------------------------
# CPU: the cases themselves, and one small case of each form through the interpreter
# ------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_cases_cover_every_width_page_size_form_and_edge():
    pool = torch.zeros(POOL_ROWS, WIDTH_1M, dtype=torch.int32)
    cases = [random_case(form, seed, pool) for form in FORMS for seed in SEEDS]
    assert {c.width for c in cases} >= {128, 1024, 65_600, WIDTH_1M}
    assert {(c.page_size, c.with_page_table_1) for c in cases} == {
        (1, True),
        (64, True),
        (64, False),
    }
    assert any(c.req_to_token.stride(0) > c.width for c in cases)
    ragged = [c for c in cases if c.op == "draft_extend" and not c.static_extend_len]
    assert any(0 in c.extend_seq_lens.tolist() and c.total_len > 0 for c in ragged)
    assert any(c.total_len == 0 for c in ragged)
    lengths = {n for c in cases for n in c.seq_lens.tolist()}
    assert {0, 1, 127, 128, 129, 1023, 1024, 1025, WIDTH_1M} <= lengths
    assert max(c.bs for c in cases) >= 30


def test_padded_cases_end_in_slot_0_at_length_1_with_the_static_extend_length():
    pool = torch.zeros(POOL_ROWS, WIDTH_1M, dtype=torch.int32)
    for seed in PADDED_SEEDS:
        case = random_case("draft_extend_ragged", seed, pool, padded=True)
        assert case.seq_lens[-1] == 1 and case.req_pool_indices[-1] == 0
        assert case.extend_seq_lens[-1] == case.max_extend_len


def test_budgets_are_1_rows_around_rows_and_past_the_default():
    pool = torch.zeros(POOL_ROWS, 2048, dtype=torch.int32)
    case = random_case("verify", 3, pool)
    rows = written_rows(case)
    assert rows == case.bs * case.next_n
    assert budgets(case)[-1] is None
    assert {1, max(1, rows - 1), rows, 3 * rows + 1} <= set(budgets(case))


def test_edge_lengths_sit_around_pages_blocks_tiles_and_the_width():
    expected = [0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 2047, 2048]
    assert edge_lengths(2048) == expected


@pytest.mark.parametrize("seed", [0, 4], ids=["a-later-request-has-more-rows", "fewer-rows"])
@pytest.mark.parametrize("form", FORMS)
def test_small_cases_of_each_form_match_sglang_in_the_interpreter(form, seed):
    """The first three requests of a case at width 300 (ragged seed 0: extend lengths 3, 4, 1)."""
    gen = torch.Generator().manual_seed(9)
    pool = torch.randint(0, 1 << 30, (POOL_ROWS, 300), dtype=torch.int32, generator=gen)
    case = random_case(form, seed, pool)
    case.seq_lens, case.req_pool_indices = case.seq_lens[:3], case.req_pool_indices[:3]
    if case.op == "draft_extend":
        case.extend_seq_lens = case.extend_seq_lens[:3]
        case.total_len = int(case.extend_seq_lens.sum())
    found = mismatches(case)
    assert not found, f"{describe(case)}: " + "; ".join(found)
