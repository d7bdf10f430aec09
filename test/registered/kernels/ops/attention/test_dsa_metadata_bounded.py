"""Bounded DSA replay-metadata kernels: bit-identical to SGLang 0.5.23's own, on whole poisoned buffers.

CPU tests run through Triton's interpreter at small widths, with one-block tiles and the default
tile, and with requests that have several programs each striding over several live tiles; GPU tests
run at SGLang's default 1M-token table and in CUDA graphs.
"""

import pytest
import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_common import bounded_num_programs
from sglang_dsa_mtp.kernels.ops.host import default_budget
from support.constants import POISON, SMALL_WIDTH, WIDTH_1M
from support.metadata_cases import (
    OPS,
    SMALL_TOPK,
    STRIDING_LENGTHS,
    STRIDING_WIDTH,
    WIDE_LENGTHS,
    WIDE_WIDTH,
    compare,
    lengths_1m,
    lengths_for,
    make_case,
    req_to_token_past_int32,
)

CPU = torch.device("cpu")

PAGE_CONFIGS = [
    pytest.param(1, True, id="page1"),
    pytest.param(64, True, id="page64"),
    pytest.param(64, False, id="page64-no-page_table_1"),
]
BUDGETS = [
    pytest.param(1, id="budget-below-rows"),
    pytest.param(5, id="budget-not-multiple-of-rows"),
    pytest.param(100_000, id="budget-above-256-cap"),
    pytest.param(None, id="budget-default"),
]


def assert_identical(case, arm="bounded", reference="sglang", budget=None):
    differing = compare(case, arm, reference=reference, budget=budget)
    assert not differing, f"{arm} differs from {reference} in {differing}"


# ------------------------------------------------------------------------------------------------
# CPU (Triton interpreter): runs in CI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bounded_decode_matches_sglang(page_size, with_pt1, bs, budget, tile_n):
    gen = torch.Generator().manual_seed(bs * 1000 + page_size)
    case = make_case(
        "decode",
        lengths_for(bs, gen),
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        page_size=page_size,
        with_page_table_1=with_pt1,
        generator=gen,
    )
    assert_identical(case, budget=budget)


@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize("bs,next_n", [(1, 1), (3, 5), (8, 2)])
@pytest.mark.parametrize("with_ctx_lens", [False, True], ids=["no-ctx-lens", "ctx-lens-2d"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bounded_target_verify_matches_sglang(
    page_size, with_pt1, bs, next_n, with_ctx_lens, budget, tile_n
):
    gen = torch.Generator().manual_seed(bs * 100 + next_n)
    # Verify reads seq_lens + next_n columns: include lengths whose kv end crosses a block.
    lengths = [max(0, n - next_n) for n in lengths_for(bs, gen)]
    case = make_case(
        "verify",
        lengths,
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=next_n,
        page_size=page_size,
        with_page_table_1=with_pt1,
        with_ctx_lens_2d=with_ctx_lens,
        generator=gen,
    )
    assert_identical(case, budget=budget)


@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bounded_draft_extend_static_matches_sglang(page_size, with_pt1, bs, budget, tile_n):
    gen = torch.Generator().manual_seed(bs * 10 + page_size)
    case = make_case(
        "draft_extend",
        lengths_for(bs, gen),
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=4,
        page_size=page_size,
        with_page_table_1=with_pt1,
        generator=gen,
    )
    assert_identical(case, budget=budget)


@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize(
    "lengths,extend_lens",
    [
        ([40, 200], [0, 3]),
        ([300, 129, 5], [3, 0, 1]),
        ([1, 1, 200, 128, 0, 77, 300, 2], [4, 1, 0, 2, 3, 4, 1, 4]),
    ],
    ids=["first-request-zero-extend", "mixed", "padded-rows-and-zero-lengths"],
)
@pytest.mark.parametrize("budget", BUDGETS)
def test_bounded_draft_extend_per_request_lengths_matches_sglang(
    page_size, with_pt1, lengths, extend_lens, budget, tile_n
):
    case = make_case(
        "draft_extend",
        lengths,
        extend_lens=extend_lens,
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=4,
        page_size=page_size,
        with_page_table_1=with_pt1,
        generator=torch.Generator().manual_seed(len(lengths)),
    )
    assert_identical(case, budget=budget)


@pytest.mark.quick
def test_bounded_draft_extend_padded_graph_rows_match_sglang():
    """Padded graph rows carry seq_len 1 and request slot 0: lengths clamp to 0, block 0 is written."""
    case = make_case(
        "draft_extend",
        [257, 1, 1],
        req_indices=[7, 0, 0],
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=3,
        generator=torch.Generator().manual_seed(3),
    )
    assert_identical(case, budget=2)


def test_bounded_draft_extend_total_len_zero_writes_only_request_lengths_like_sglang():
    """With no extend rows SGLang copies seq_lens whole into cache_seqlens (so that buffer must be
    exactly bs long, as the backend's per-bs buffers are) and writes no page table."""
    case = make_case(
        "draft_extend",
        [5, 130],
        extend_lens=[0, 0],
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=3,
    )
    results = {}
    for arm in ("sglang", "bounded"):
        out = case.outputs()
        out["cache_seqlens"] = out["cache_seqlens"][: case.bs]
        results[arm] = case.run(arm, out)
    for name, tensor in results["sglang"].items():
        if tensor is not None:
            assert torch.equal(tensor, results["bounded"][name]), name
    assert results["bounded"]["cu_seqlens_k"][:3].tolist() == [0, 5, 135]
    assert (results["bounded"]["page_table_1"] == POISON).all()


@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_bounded_bs0_only_zeroes_the_cumsum_heads(op):
    case = make_case(op, [], width=SMALL_WIDTH, device=CPU, topk=SMALL_TOPK, next_n=2)
    assert_identical(case)
    out = case.run("bounded", case.outputs())
    assert out["cu_seqlens_k"][0] == 0 and out["dsa_cu_seqlens_k"][0] == 0
    assert (out["cu_seqlens_k"][1:] == POISON).all()


@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
@pytest.mark.parametrize("width", [128, 256, 1100], ids=["w128", "w256", "w1100"])
def test_bounded_matches_sglang_at_length_equal_width(op, width, tile_n):
    case = make_case(
        op, [width, width - 1, 0], width=width, device=CPU, topk=SMALL_TOPK, next_n=2, page_size=64
    )
    assert_identical(case, budget=3)


@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_bounded_matches_sglang_kpool_kernels_at_kpool_1(op, tile_n):
    """SGLang's own bounded-grid KPool kernels at index_kpool=1 are a second reference."""
    gen = torch.Generator().manual_seed(7)
    case = make_case(
        op,
        lengths_for(5, gen),
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=3,
        generator=gen,
    )
    assert_identical(case, reference="sglang_kpool", budget=4)


@pytest.mark.parametrize("op", OPS)
def test_fewer_programs_than_live_tiles_share_them_across_requests_as_sglang_writes_them(
    op, few_programs, tile_n, launch_grids
):
    """Fewer programs than the batch's live tiles, live ends that are not a whole number of tiles:
    every tile, the partial last one too, whichever program takes it, is written as SGLang writes
    it."""
    next_n = 2
    lengths = STRIDING_LENGTHS
    if op == "verify":  # verify's live length is seq_lens + next_n
        lengths = [n - next_n for n in lengths]
    case = make_case(
        op,
        lengths,
        width=STRIDING_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=next_n,
        generator=torch.Generator().manual_seed(tile_n),
    )
    assert_identical(case, budget=few_programs)
    assert launch_grids == [(1 + few_programs,)]


@pytest.mark.parametrize(
    "op,extend_lens",
    [("decode", None), ("verify", None), ("draft_extend", None), ("draft_extend", [3, 0, 2])],
    ids=["decode", "verify", "draft-extend-static", "draft-extend-per-request"],
)
@pytest.mark.parametrize("page_size", [1, 64], ids=["page1", "page64"])
@pytest.mark.parametrize("budget", [2, None], ids=["budget-2", "budget-default"])
def test_requests_spanning_three_tiles_or_more_match_sglang(
    op, extend_lens, page_size, budget, tile_n
):
    """Every tile of a request that spans three tiles or more, of one block and of the default
    tile, lands at its own columns, whichever program takes it."""
    next_n = 3
    lengths = WIDE_LENGTHS
    if op == "verify":  # verify's live length is seq_lens + next_n
        lengths = [n - next_n for n in lengths]
    case = make_case(
        op,
        lengths,
        extend_lens=extend_lens,
        width=WIDE_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=next_n,
        page_size=page_size,
        generator=torch.Generator().manual_seed(tile_n + page_size),
    )
    assert_identical(case, budget=budget)


@pytest.mark.parametrize("bs", [1, 3, 7])
def test_bounded_verify_lanes_past_bs_are_no_requests_where_the_inputs_go_on(bs, tile_n):
    """SGLang passes ``seq_lens[:bs]`` and ``req_pool_indices[:bs]`` of its graph runner's max-bs
    buffers, which go on past ``bs``. Verify's KV length is ``seq_lens + next_n``: the lanes a
    program holds past ``bs`` (up to the next power of two) must not count as requests of length
    ``next_n``, whose rows would be the spare rows past ``bs * next_n`` that SGLang leaves as they
    were (compared whole)."""
    next_n = 2
    gen = torch.Generator().manual_seed(bs)
    case = make_case(
        "verify",
        lengths_for(bs, gen),
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=next_n,
        generator=gen,
    )
    graph_seq_lens = torch.full((2 * bs + 2,), SMALL_WIDTH - next_n, dtype=torch.int64)
    graph_slots = torch.arange(2 * bs + 2, dtype=torch.int64) % case.req_to_token.shape[0]
    graph_seq_lens[:bs], graph_slots[:bs] = case.seq_lens, case.req_pool_indices
    case.seq_lens, case.req_pool_indices = graph_seq_lens[:bs], graph_slots[:bs]
    assert_identical(case, budget=3)


@pytest.mark.parametrize("op", OPS)
def test_bounded_launch_grid_depends_only_on_requests_width_and_budget(op, grid_case, launch_grids):
    """The grid each wrapper launches is the same for empty, full and mixed live lengths."""
    bs, width, budget, programs = grid_case
    gen = torch.Generator().manual_seed(bs)
    mixed = torch.randint(1, width, (bs,), generator=gen).tolist()
    for lengths in ([0] * bs, [width] * bs, mixed):
        case = make_case(op, lengths, width=width, device=CPU, topk=SMALL_TOPK, next_n=2)
        case.run("bounded", case.outputs(), budget=budget)
    assert launch_grids == [(1 + programs,)] * 3


@pytest.mark.parametrize(
    "requests,width,budget,expected",
    [
        (1, WIDTH_1M, None, None),
        (1, WIDTH_1M, 100_000, 1025),
        (16, WIDTH_1M, 1056, 1056),
        (48, WIDTH_1M, 8, 8),
        (4, 128, 1024, 4),
        (1, 300, 64, 1),
        (2, 2100, 100_000, 6),
        (5, 0, 64, 1),
    ],
)
def test_bounded_num_programs_is_the_budget_or_the_tiles_of_full_rows(
    requests, width, budget, expected
):
    if budget is None:
        budget = default_budget(CPU)
        expected = budget
    assert bounded_num_programs(requests, width, budget) == expected


@pytest.mark.parametrize("op", OPS)
def test_bounded_int32_request_slots_past_int32_req_to_token_offsets_match_sglang(op):
    """int32 ``req_pool_indices`` whose rows start past 2**31 elements: the kernels widen the slot
    before multiplying by the row stride. Checked against a torch gather of the slots' rows and
    against SGLang's kernel given the same slots as int64 (SGLang's own kernel does not widen)."""
    gen = torch.Generator().manual_seed(31)
    req_to_token, far = req_to_token_past_int32(SMALL_WIDTH, gen)
    next_n = 2
    lengths = [SMALL_WIDTH - next_n, 129, 0, 200]
    case = make_case(
        op,
        lengths,
        req_indices=[far[0], 3, far[1], far[2]],
        width=SMALL_WIDTH,
        device=CPU,
        topk=SMALL_TOPK,
        next_n=next_n,
        req_to_token=req_to_token,
    )
    expected = case.run("sglang", case.outputs())
    slots = case.req_pool_indices
    case.req_pool_indices = slots.int()
    actual = case.run("bounded", case.outputs())
    rows_per_request = 1 if op == "decode" else next_n
    live = case.seq_lens + (next_n if op == "verify" else 0)
    for row in range(case.rows):
        request = row // rows_per_request
        live_end = min(SMALL_WIDTH, 128 * triton.cdiv(int(live[request]), 128))
        gathered = req_to_token[slots[request], :live_end]
        assert torch.equal(actual["page_table_1"][row, :live_end], gathered), f"row {row}"
    for name, tensor in expected.items():
        if tensor is not None:
            assert torch.equal(actual[name], tensor), f"{name} differs from SGLang's"


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------


def _decode_case():
    return make_case("decode", [10, 200], width=SMALL_WIDTH, device=CPU)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda kw: kw.update(req_to_token=kw["req_to_token"].long()),
            "req_to_token must be int32",
        ),
        (
            lambda kw: kw.update(page_table_1=kw["page_table_1"].long()),
            "page_table_1 must be int32",
        ),
        (
            lambda kw: kw.update(page_table_1=kw["page_table_1"][:1]),
            "page_table_1 must be at least",
        ),
        (lambda kw: kw.update(real_page_table=None), "real_page_table is required"),
        (
            lambda kw: kw.update(cu_seqlens_k=kw["cu_seqlens_k"][:2]),
            "cu_seqlens_k needs at least 3",
        ),
        (
            lambda kw: kw.update(seq_lens=kw["seq_lens"].float()),
            "seq_lens must be an int32 or int64",
        ),
        (lambda kw: kw.update(max_len=SMALL_WIDTH + 1), "width must be an int in"),
        (lambda kw: kw.update(budget=-1), "budget must be None or an int >= 1"),
        (lambda kw: kw.update(budget=0), "budget must be None or an int >= 1"),
        (lambda kw: kw.update(physical_page_size=1, page_table_1=None), "page_table_1 is required"),
    ],
    ids=[
        "int64-req_to_token",
        "int64-page_table_1",
        "short-page_table_1",
        "missing-real_page_table",
        "short-cu_seqlens_k",
        "float-seq_lens",
        "width-past-req_to_token",
        "negative-budget",
        "zero-budget",
        "page1-without-page_table_1",
    ],
)
def test_bounded_decode_rejects_bad_arguments_by_name(mutate, match):
    case = _decode_case()
    kw = case.kwargs(case.outputs())
    kw["budget"] = None
    mutate(kw)
    with pytest.raises((TypeError, ValueError), match=match):
        bounded.fused_dsa_decode_metadata_bounded(**kw)


@pytest.mark.parametrize("op", OPS)
def test_bounded_rejects_a_real_page_table_one_page_short_by_name(op):
    """The compact table takes one entry per page start: ``cdiv(width, page)`` per row. At a width
    that is not a multiple of the page (300 = 4 pages of 64 and 44 columns), ``width // page`` is
    one page short."""
    case = make_case(
        op, [SMALL_WIDTH - 2, 10], width=SMALL_WIDTH, device=CPU, topk=SMALL_TOPK, next_n=2
    )
    out = case.outputs()
    out["real_page_table"] = out["real_page_table"][:, : SMALL_WIDTH // case.page_size]
    with pytest.raises(ValueError, match=r"^real_page_table must be at least .*=5\), got"):
        case.run("bounded", out)
    assert all((t == POISON).all() for t in out.values() if t is not None), "it wrote"


@pytest.mark.quick
def test_bounded_verify_rejects_wrong_ctx_lens_shape():
    case = make_case("verify", [10, 20], width=SMALL_WIDTH, device=CPU, topk=SMALL_TOPK, next_n=3)
    kw = case.kwargs(case.outputs())
    kw["paged_mqa_ctx_lens_2d"] = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"paged_mqa_ctx_lens_2d must have shape \(bs, next_n\)"):
        bounded.fused_dsa_target_verify_metadata_bounded(**kw)


def test_bounded_draft_extend_rejects_total_len_past_capacity():
    case = make_case(
        "draft_extend", [10, 20], width=SMALL_WIDTH, device=CPU, topk=SMALL_TOPK, next_n=2
    )
    kw = case.kwargs(case.outputs())
    kw["total_len"] = 5
    with pytest.raises(ValueError, match="total_len"):
        bounded.fused_dsa_draft_extend_metadata_bounded(**kw)


# ------------------------------------------------------------------------------------------------
# GPU (H200): 1M-token table, int64 addressing, CUDA graphs
# ------------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
@pytest.mark.parametrize("bs", [1, 4, 16, 32])
@pytest.mark.parametrize("page_size", [1, 64])
def test_bounded_matches_sglang_at_1m_table(op, bs, page_size, req_to_token_1m):
    gen = torch.Generator().manual_seed(bs)
    lengths = lengths_1m(bs, gen)
    if op == "verify":
        lengths = [max(0, n - 5) for n in lengths]
    case = make_case(
        op,
        lengths,
        width=WIDTH_1M,
        device=CUDA,
        next_n=5,
        page_size=page_size,
        req_to_token=req_to_token_1m,
        generator=gen,
    )
    for budget in (None, bs, 7 * bs + 3):
        assert_identical(case, budget=budget)
    assert_identical(case, reference="sglang_kpool")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_bounded_matches_sglang_past_int32_req_to_token_offsets(op):
    """Request slots whose req_to_token row starts past 2**31 elements need int64 addressing."""
    pool_rows = 2**31 // WIDTH_1M + 3
    req_to_token = torch.empty((pool_rows, WIDTH_1M), dtype=torch.int32, device=CUDA)
    req_to_token.random_(0, 1 << 30)
    last = pool_rows - 1
    assert last * WIDTH_1M > 2**31
    case = make_case(
        op,
        [WIDTH_1M - 5, 70_000, 129],
        req_indices=[last, 0, last - 1],
        width=WIDTH_1M,
        device=CUDA,
        next_n=5,
        req_to_token=req_to_token,
    )
    assert_identical(case)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_bounded_cuda_graph_replays_match_sglang_with_new_lengths(op, req_to_token_1m):
    """Capture once; replay with growing, shrinking, zero and full-width lengths, comparing after
    every replay against SGLang's kernel run on its own buffers through the same sequence."""
    bs, next_n = 4, 5
    case = make_case(
        op, [1000] * bs, width=WIDTH_1M, device=CUDA, next_n=next_n, req_to_token=req_to_token_1m
    )
    seq_lens, req_pool_indices = case.seq_lens, case.req_pool_indices
    ours, theirs = case.outputs(), case.outputs()
    case.run("bounded", ours)  # compile before capture; SGLang's buffers see the same call
    case.run("sglang", theirs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run("bounded", ours)
    full = WIDTH_1M - (next_n if op == "verify" else 0)
    rounds = [
        [1000, 2000, 64, 129],
        [70_000, 300_000, 128, 1_000_000],
        [10, 0, 5, 1],
        [0, 0, 0, 0],
        [full, full - 1, 127, 8193 * 128 - 200],
        [500, 1, 300_000, 9],
    ]
    for i, lengths in enumerate(rounds):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int64))
        req_pool_indices.copy_(torch.randperm(40)[:bs])
        graph.replay()
        case.run("sglang", theirs)
        torch.cuda.synchronize()
        for name, tensor in theirs.items():
            if tensor is not None:
                assert torch.equal(tensor, ours[name]), f"replay {i}: {name} differs"
