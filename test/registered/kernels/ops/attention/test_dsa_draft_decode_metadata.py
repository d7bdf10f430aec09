"""One-launch MTP draft-decode metadata: ``fused_dsa_draft_decode_metadata_multi``.

Two references, both run through the same inputs:

(a) Per destination, the single-destination decode kernels, each into its own identically poisoned
    buffers: our ``fused_dsa_decode_metadata_bounded`` and SGLang's ``fused_dsa_decode_metadata``.
    Every element of every buffer of every destination must be equal: the one launch writes exactly
    the blocks the decode kernel writes, and leaves everything else as it was.

(b) The stock MTP path of SGLang 0.5.23 (kpool 1): its decode kernel into a ``torch.empty`` full-width
    scratch (``dsa_backend_mtp_precompute._precompute_decode_mode``), then full-width copies of every
    scratch buffer into each step backend (``fused_metadata_copy_multi_cuda`` /
    ``_copy_base_replay_buffers``). What the stock path leaves unspecified, and so what is not
    compared: in rows ``r < bs``, the page-table columns past the live blocks, i.e. ``page_table_1``
    columns ``>= min(width, 128 * cdiv(seq_lens[r], 128))`` and ``real_page_table`` columns past the
    page starts of that region: the stock path copies them from the ``torch.empty`` scratch (whatever
    the allocator hands back), where the one launch leaves the old contents. The stock copies never
    write the cumsum heads ``cu_seqlens_k[0]`` / ``dsa_cu_seqlens_k[0]`` (CUDA-graph capture zeroed
    them), so both arms start from buffers whose heads are 0, as capture leaves them. Everything else
    is compared element by element: the live blocks of rows ``< bs``, the length vectors, and the rows
    and entries past ``bs``, which neither path touches.

CPU tests run through Triton's interpreter at small widths; GPU tests at SGLang's default 1M-token
table and in CUDA graphs.
"""

import pytest
import torch
import triton

from sglang_dsa_mtp.kernels.ops.attention.dsa_draft_decode_metadata import (
    DecodeMetadataDestination,
    fused_dsa_draft_decode_metadata_multi,
)
from support.constants import POISON, SMALL_WIDTH, WIDTH_1M
from support.metadata_cases import (
    SMALL_TOPK,
    STRIDING_LENGTHS,
    STRIDING_WIDTH,
    WIDE_LENGTHS,
    WIDE_WIDTH,
    lengths_1m,
    lengths_for,
    make_case,
    req_to_token_past_int32,
    run_draft_decode_multi,
    run_stock_draft_decode,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")

DESTINATIONS = [pytest.param(n, id=f"{n}-dest") for n in (1, 2, 3, 4)]
PAGE_CONFIGS = [
    pytest.param(1, True, id="page1"),
    pytest.param(64, True, id="page64"),
    pytest.param(64, False, id="page64-no-page_table_1"),
]
# Under speculative decoding every draft step backend has page_table_1 (design map 2.6), which the
# stock path copies: it is compared at both page sizes, with page_table_1.
STOCK_PAGE_SIZES = [pytest.param(1, id="page1"), pytest.param(64, id="page64")]
BUDGETS = [
    pytest.param(1, id="budget-below-rows"),
    pytest.param(5, id="budget-not-multiple-of-rows"),
    pytest.param(100_000, id="budget-above-256-cap"),
    pytest.param(None, id="budget-default"),
]


def decode_case(lengths, *, device=CPU, width=SMALL_WIDTH, **options):
    options.setdefault("topk", SMALL_TOPK if width == SMALL_WIDTH else 2048)
    return make_case("decode", lengths, width=width, device=device, **options)


def assert_each_destination_matches_decode_kernels(case, outs, budget=None):
    """(a): every destination equals the bounded and SGLang decode kernels' own poisoned buffers."""
    for arm in ("bounded", "sglang"):
        expected = case.run(arm, case.outputs(), budget=budget)
        for i, out in enumerate(outs):
            for name, tensor in expected.items():
                if tensor is not None:
                    assert torch.equal(out[name], tensor), f"destinations[{i}].{name} != {arm}'s"


def captured_outputs(case):
    """Poisoned buffers with the cumsum heads zeroed, as CUDA-graph capture leaves them."""
    out = case.outputs()
    out["cu_seqlens_k"][0] = 0
    out["dsa_cu_seqlens_k"][0] = 0
    return out


def stock_specified(case, name, tensor):
    """Where the stock path defines ``tensor``: all but each live row's page-table tail."""
    specified = torch.ones(tensor.shape, dtype=torch.bool, device=tensor.device)
    if name in ("page_table_1", "real_page_table"):
        per_column = 1 if name == "page_table_1" else case.page_size
        for row, seq in enumerate(case.seq_lens.tolist()):
            live_end = min(case.width, 128 * triton.cdiv(seq, 128))
            specified[row, triton.cdiv(live_end, per_column) :] = False
    return specified


def assert_matches_stock_on_specified_region(case, num_dest, foreach=False):
    ours = run_draft_decode_multi(case, [captured_outputs(case) for _ in range(num_dest)])
    stock = [captured_outputs(case) for _ in range(num_dest)]
    run_stock_draft_decode(case, stock, foreach=foreach)
    for i, (mine, theirs) in enumerate(zip(ours, stock)):
        for name, tensor in theirs.items():
            if tensor is None:
                continue
            specified = stock_specified(case, name, tensor)
            assert torch.equal(
                mine[name][specified], tensor[specified]
            ), f"destinations[{i}].{name} differs from the stock precompute + copies"


# ------------------------------------------------------------------------------------------------
# CPU (Triton interpreter): runs in CI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("budget", BUDGETS)
def test_each_destination_gets_exactly_what_the_decode_kernels_write(
    num_dest, page_size, with_pt1, bs, budget, tile_n
):
    gen = torch.Generator().manual_seed(bs * 1000 + page_size * 10 + num_dest)
    case = decode_case(
        lengths_for(bs, gen), page_size=page_size, with_page_table_1=with_pt1, generator=gen
    )
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget=budget)
    assert_each_destination_matches_decode_kernels(case, outs, budget=budget)


@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("page_size", STOCK_PAGE_SIZES)
@pytest.mark.parametrize("bs", [1, 3, 8])
def test_matches_stock_precompute_and_full_width_copies_where_stock_is_defined(
    num_dest, page_size, bs
):
    gen = torch.Generator().manual_seed(bs * 100 + page_size + num_dest)
    case = decode_case(lengths_for(bs, gen), page_size=page_size, generator=gen)
    assert_matches_stock_on_specified_region(case, num_dest)


@pytest.mark.parametrize("page_size", STOCK_PAGE_SIZES)
def test_stock_path_with_batched_foreach_copies_matches_too(page_size):
    """The benchmark's second stock arm: the same copies in one torch._foreach_copy_."""
    gen = torch.Generator().manual_seed(page_size)
    case = decode_case(lengths_for(8, gen), page_size=page_size, generator=gen)
    assert_matches_stock_on_specified_region(case, 3, foreach=True)


@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("width", [128, 256, 1100], ids=["w128", "w256", "w1100"])
def test_matches_decode_kernels_at_length_equal_width(num_dest, width, tile_n):
    case = decode_case([width, width - 1, 0], width=width, topk=SMALL_TOPK)
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget=3)
    assert_each_destination_matches_decode_kernels(case, outs, budget=3)


@pytest.mark.parametrize("num_dest", [1, 4], ids=["1-dest", "4-dest"])
@pytest.mark.parametrize("page_size", [1, 64], ids=["page1", "page64"])
@pytest.mark.parametrize("budget", [2, None], ids=["budget-2", "budget-default"])
def test_requests_spanning_three_tiles_or_more_reach_every_destination(
    num_dest, page_size, budget, tile_n
):
    """Every tile of a request that spans three tiles or more, of one block and of the default tile,
    lands at its own columns of every destination, whichever program takes it."""
    case = decode_case(
        WIDE_LENGTHS,
        width=WIDE_WIDTH,
        topk=SMALL_TOPK,
        page_size=page_size,
        generator=torch.Generator().manual_seed(tile_n + page_size),
    )
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget=budget)
    assert_each_destination_matches_decode_kernels(case, outs, budget=budget)


@pytest.mark.parametrize("num_dest", [1, 4])
def test_repeated_calls_with_new_lengths_match_the_decode_kernels_on_their_own_buffers(num_dest):
    """As CUDA-graph replays do: the same buffers, new lengths and request slots every call; what a
    longer earlier call wrote stays past the new live blocks, exactly as with the decode kernels."""
    gen = torch.Generator().manual_seed(5)
    case = decode_case([100, 200, 5], generator=gen)
    outs = [case.outputs() for _ in range(num_dest)]
    references = {arm: case.outputs() for arm in ("bounded", "sglang")}
    rounds = [[300, 299, 129], [1, 0, 128], [0, 0, 0], [250, 17, 300]]
    for i, lengths in enumerate(rounds):
        case.seq_lens.copy_(torch.tensor(lengths))
        case.req_pool_indices.copy_(torch.randperm(16, generator=gen)[: case.bs])
        run_draft_decode_multi(case, outs, budget=2)
        for arm, reference in references.items():
            case.run(arm, reference, budget=2)
            for d, out in enumerate(outs):
                for name, tensor in reference.items():
                    if tensor is not None:
                        assert torch.equal(out[name], tensor), f"call {i}: [{d}].{name} != {arm}"


@pytest.mark.parametrize("num_dest", [1, 3])
def test_bs0_only_zeroes_each_destinations_cumsum_heads(num_dest):
    case = decode_case([])
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)])
    assert_each_destination_matches_decode_kernels(case, outs)
    for out in outs:
        assert out["cu_seqlens_k"][0] == 0 and out["dsa_cu_seqlens_k"][0] == 0
        assert (out["cu_seqlens_k"][1:] == POISON).all()


@pytest.mark.quick
def test_page_size_1_ignores_real_page_table_like_the_decode_kernels():
    """With page size 1 the compact table is page_table_1 itself; a real_page_table argument
    (even one that differs between destinations) is neither checked against the others nor written.
    """
    case = decode_case([130, 7], page_size=1)
    outs = [case.outputs() for _ in range(3)]
    stray = torch.full((5, 3), POISON, dtype=torch.int32)
    outs[1]["real_page_table"] = stray
    run_draft_decode_multi(case, outs)
    assert (stray == POISON).all()
    assert_each_destination_matches_decode_kernels(case, outs)


@pytest.mark.parametrize("num_dest", [1, 4])
def test_each_destination_matches_when_fewer_programs_share_the_live_tiles(
    num_dest, few_programs, tile_n, launch_grids
):
    """Fewer programs than the batch's live tiles, live ends that are not a whole number of tiles:
    every destination gets every tile, the partial last one too."""
    case = decode_case(
        STRIDING_LENGTHS,
        width=STRIDING_WIDTH,
        topk=SMALL_TOPK,
        generator=torch.Generator().manual_seed(tile_n + num_dest),
    )
    budget = few_programs
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget=budget)
    assert launch_grids == [(1 + budget,)]
    assert_each_destination_matches_decode_kernels(case, outs, budget=budget)


@pytest.mark.parametrize("num_dest", [1, 4])
def test_grid_depends_only_on_bs_width_and_budget_never_on_live_lengths(
    num_dest, grid_case, launch_grids
):
    bs, width, budget, programs = grid_case
    gen = torch.Generator().manual_seed(bs)
    mixed = torch.randint(1, width, (bs,), generator=gen).tolist()
    for lengths in ([0] * bs, [width] * bs, mixed):
        case = decode_case(lengths, width=width, topk=SMALL_TOPK)
        run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget=budget)
    assert launch_grids == [(1 + programs,)] * 3


def test_int32_request_slots_past_int32_req_to_token_offsets_match_the_decode_kernels():
    """int32 ``req_pool_indices`` whose rows start past 2**31 elements: the one launch widens the
    slot before multiplying by the row stride. Checked against a torch gather of the slots' rows and
    against the decode kernels given the same slots as int64 (SGLang's own kernel does not widen).
    """
    gen = torch.Generator().manual_seed(31)
    req_to_token, far = req_to_token_past_int32(SMALL_WIDTH, gen)
    case = decode_case(
        [SMALL_WIDTH, 129, 0, 200],
        req_indices=[far[0], 3, far[1], far[2]],
        req_to_token=req_to_token,
    )
    slots = case.req_pool_indices
    case.req_pool_indices = slots.int()
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(2)])
    for row, seq in enumerate(case.seq_lens.tolist()):
        live_end = min(SMALL_WIDTH, 128 * triton.cdiv(seq, 128))
        gathered = req_to_token[slots[row], :live_end]
        for i, out in enumerate(outs):
            assert torch.equal(out["page_table_1"][row, :live_end], gathered), f"[{i}] row {row}"
    case.req_pool_indices = slots
    assert_each_destination_matches_decode_kernels(case, outs)


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------


def _replace(outs, i, **fields):
    outs[i] = outs[i]._replace(**fields)


def _poisoned(*shape):
    return torch.full(shape, POISON, dtype=torch.int32)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda outs: outs.clear(),
            r"destinations must hold 1 to 4 DecodeMetadataDestination, got 0",
        ),
        (lambda outs: outs.append(outs[0]), r"destinations must hold 1 to 4 .*got 5"),
        (
            lambda outs: outs.__setitem__(1, dict(outs[1]._asdict())),
            r"destinations\[1\] must be a ",
        ),
        (
            lambda outs: _replace(outs, 1, page_table_1=_poisoned(5, 310)),
            r"destinations\[1\]\.page_table_1 has shape \(5, 310\).*expected shape \(4, 300\).*"
            r"all destinations must match",
        ),
        (
            lambda outs: _replace(outs, 2, page_table_1=_poisoned(4, 304)[:, :300]),
            r"destinations\[2\]\.page_table_1 has .*stride \(304, 1\).*expected .*stride \(300, 1\)",
        ),
        (
            lambda outs: _replace(outs, 1, page_table_1=None),
            r"destinations\[1\]\.page_table_1 is None but destinations\[0\]\.page_table_1 is shape",
        ),
        (
            lambda outs: _replace(outs, 0, page_table_1=None),
            r"destinations\[1\]\.page_table_1 is shape .* but destinations\[0\]\.page_table_1 is None",
        ),
        (
            lambda outs: _replace(outs, 3, real_page_table=None),
            r"destinations\[3\]\.real_page_table is required when physical_page_size > 1",
        ),
        (
            lambda outs: _replace(outs, 1, real_page_table=_poisoned(6, 5)),
            r"destinations\[1\]\.real_page_table has shape \(6, 5\).*expected shape \(4, 5\)",
        ),
        (  # width 300 is 4 pages of 64 and 44 columns: cdiv(300, 64) = 5 entries a row, not 4
            lambda outs: _replace(outs, 0, real_page_table=outs[0].real_page_table[:, :4]),
            r"destinations\[0\]\.real_page_table must be at least \(2, cdiv\(width, "
            r"physical_page_size\)=5\), got \(4, 4\)",
        ),
        (
            lambda outs: _replace(outs, 3, cache_seqlens=outs[3].cache_seqlens.long()),
            r"destinations\[3\]\.cache_seqlens must be int32",
        ),
        (
            lambda outs: _replace(outs, 1, cu_seqlens_k=outs[1].cu_seqlens_k[:2]),
            r"destinations\[1\]\.cu_seqlens_k needs at least 3 entries",
        ),
        (
            lambda outs: _replace(outs, 1, cache_seqlens=_poisoned(9)),
            r"destinations\[1\]\.cache_seqlens has shape \(9,\).*expected shape \(4,\)",
        ),
        (
            lambda outs: _replace(outs, 2, dsa_cache_seqlens=_poisoned(8)[::2]),
            r"destinations\[2\]\.dsa_cache_seqlens must be contiguous",
        ),
        (
            lambda outs: _replace(
                outs, 2, page_table_1=torch.empty((4, 300), dtype=torch.int32, device="meta")
            ),
            r"destinations\[2\]\.page_table_1 is on meta, expected cpu",
        ),
    ],
    ids=[
        "no-destinations",
        "five-destinations",
        "dict-not-destination",
        "page_table_1-shape-mismatch",
        "page_table_1-stride-mismatch",
        "page_table_1-presence-mismatch",
        "page_table_1-missing-in-destination-0",
        "real_page_table-missing",
        "real_page_table-shape-mismatch",
        "real_page_table-one-page-short",
        "int64-cache_seqlens",
        "short-cu_seqlens_k",
        "cache_seqlens-length-mismatch",
        "non-contiguous-dsa_cache_seqlens",
        "page_table_1-on-another-device",
    ],
)
def test_rejects_bad_destinations_by_name_and_writes_nothing(mutate, match):
    case = decode_case([10, 200], page_size=64)
    outs = [DecodeMetadataDestination(**case.outputs()) for _ in range(4)]
    mutate(outs)
    with pytest.raises((TypeError, ValueError), match=match):
        fused_dsa_draft_decode_metadata_multi(
            case.seq_lens,
            case.req_pool_indices,
            case.req_to_token,
            outs,
            bs=case.bs,
            max_len=case.width,
            dsa_index_topk=case.topk,
            physical_page_size=case.page_size,
        )
    buffers = [t for dest in outs for t in (dest.values() if isinstance(dest, dict) else dest)]
    assert all((t == POISON).all() for t in buffers if t is not None and t.device == CPU)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(destinations=None), r"destinations must be a list or tuple"),
        ("single", r"destinations must be a list or tuple of DecodeMetadataDestination"),
        (dict(req_to_token="int64"), r"^req_to_token must be int32"),
        (dict(budget=0), r"^budget must be None or an int >= 1"),
        (dict(max_len=SMALL_WIDTH + 1), r"^the page-table width must be an int in"),
        (
            dict(physical_page_size=1, no_page_table_1=True),
            r"destinations\[0\]\.page_table_1 is required when physical_page_size == 1",
        ),
    ],
    ids=[
        "none",
        "bare-destination",
        "int64-req_to_token",
        "zero-budget",
        "width-past-req_to_token",
        "page1-without-page_table_1",
    ],
)
def test_rejects_bad_arguments_by_name(change, match):
    case = decode_case([10, 200], page_size=64)
    outs = [DecodeMetadataDestination(**case.outputs()) for _ in range(2)]
    kw = dict(
        seq_lens=case.seq_lens,
        req_pool_indices=case.req_pool_indices,
        req_to_token=case.req_to_token,
        destinations=outs,
        bs=case.bs,
        max_len=case.width,
        dsa_index_topk=case.topk,
        physical_page_size=case.page_size,
    )
    if change == "single":
        kw["destinations"] = outs[0]
    else:
        change = dict(change)
        if change.pop("no_page_table_1", False):
            kw["destinations"] = [d._replace(page_table_1=None) for d in outs]
        if change.get("req_to_token") == "int64":
            change["req_to_token"] = case.req_to_token.long()
        kw.update(change)
    with pytest.raises((TypeError, ValueError), match=match):
        fused_dsa_draft_decode_metadata_multi(**kw)


# ------------------------------------------------------------------------------------------------
# GPU (H200): 1M-token table, int64 addressing, CUDA graphs
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("page_size,with_pt1", PAGE_CONFIGS)
@pytest.mark.parametrize("bs", [1, 4, 16, 32])
def test_each_destination_matches_decode_kernels_at_1m_table(
    num_dest, page_size, with_pt1, bs, req_to_token_1m
):
    gen = torch.Generator().manual_seed(bs * 10 + num_dest)
    case = decode_case(
        lengths_1m(bs, gen),
        device=CUDA,
        width=WIDTH_1M,
        page_size=page_size,
        with_page_table_1=with_pt1,
        req_to_token=req_to_token_1m,
        generator=gen,
    )
    for budget in (None, bs, 7 * bs + 3):
        outs = run_draft_decode_multi(case, [case.outputs() for _ in range(num_dest)], budget)
        assert_each_destination_matches_decode_kernels(case, outs, budget=budget)


@pytest.mark.gpu
@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("page_size", STOCK_PAGE_SIZES)
@pytest.mark.parametrize("bs", [1, 4, 16, 32])
def test_matches_stock_precompute_and_copies_at_1m_table(num_dest, page_size, bs, req_to_token_1m):
    gen = torch.Generator().manual_seed(bs * 100 + num_dest)
    case = decode_case(
        lengths_1m(bs, gen),
        device=CUDA,
        width=WIDTH_1M,
        page_size=page_size,
        req_to_token=req_to_token_1m,
        generator=gen,
    )
    assert_matches_stock_on_specified_region(case, num_dest)


@pytest.mark.gpu
def test_matches_decode_kernels_past_int32_req_to_token_offsets():
    """Request slots whose req_to_token row starts past 2**31 elements need int64 addressing."""
    pool_rows = 2**31 // WIDTH_1M + 3
    req_to_token = torch.empty((pool_rows, WIDTH_1M), dtype=torch.int32, device=CUDA)
    req_to_token.random_(0, 1 << 30)
    last = pool_rows - 1
    assert last * WIDTH_1M > 2**31
    case = decode_case(
        [WIDTH_1M - 5, 70_000, 129],
        req_indices=[last, 0, last - 1],
        device=CUDA,
        width=WIDTH_1M,
        req_to_token=req_to_token,
    )
    outs = run_draft_decode_multi(case, [case.outputs() for _ in range(4)])
    assert_each_destination_matches_decode_kernels(case, outs)


@pytest.mark.gpu
@pytest.mark.parametrize("num_dest", DESTINATIONS)
@pytest.mark.parametrize("page_size", [1, 64])
def test_cuda_graph_replays_match_per_destination_kernels_with_new_lengths(
    num_dest, page_size, req_to_token_1m
):
    """Capture the one launch once; replay with growing, shrinking, zero and full-width lengths,
    comparing every destination after every replay against the bounded and SGLang decode kernels,
    each run on its own buffers through the same sequence."""
    bs = 4
    case = decode_case(
        [1000] * bs,
        device=CUDA,
        width=WIDTH_1M,
        page_size=page_size,
        req_to_token=req_to_token_1m,
    )
    seq_lens, req_pool_indices = case.seq_lens, case.req_pool_indices
    outs = [case.outputs() for _ in range(num_dest)]
    references = {arm: case.outputs() for arm in ("bounded", "sglang")}
    run_draft_decode_multi(case, outs)  # compile before capture; the references see the same call
    for arm, reference in references.items():
        case.run(arm, reference)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_draft_decode_multi(case, outs)
    rounds = [
        [1000, 2000, 64, 129],
        [70_000, 300_000, 128, 1_000_000],
        [10, 0, 5, 1],
        [0, 0, 0, 0],
        [WIDTH_1M, WIDTH_1M - 1, 127, 8193 * 128 - 200],
        [500, 1, 300_000, 9],
    ]
    for i, lengths in enumerate(rounds):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int64))
        req_pool_indices.copy_(torch.randperm(40)[:bs])
        graph.replay()
        for arm, reference in references.items():
            case.run(arm, reference)
        torch.cuda.synchronize()
        for arm, reference in references.items():
            for d, out in enumerate(outs):
                for name, tensor in reference.items():
                    if tensor is not None:
                        assert torch.equal(out[name], tensor), f"replay {i}: [{d}].{name} != {arm}"
