"""Chunked indexer logits, live columns only: the copy kernel on whole poisoned buffers, and the
chunked logits against SGLang 0.5.23's chunked concat (its own closure and split function, its torch
paged-MQA logits, its masking and top-k after them).

CPU tests run through Triton's interpreter with a shrunken SM count (the chunk size) and narrow
widths; GPU tests run at the device's SM count, at SGLang's 1M-token width for the kernel, and in
CUDA graphs replayed with new lengths.
"""

import runpy
from pathlib import Path

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.kernels.ops.host import default_budget
from support import constants
from support import indexer_cases as cases
from support.timing import capture_graph

CPU = torch.device("cpu")
POISON = float("nan")  # every output starts with it; a NaN never compares bit-equal by accident
WIDTH_1M = constants.WIDTH_1M  # SGLang's default 1M-token context
SMALL_WIDTH = 34 * cases.BLOCK_KV  # 2176: past 2049, the largest edge length
CPU_SM_COUNT = 4
CPU_HEADS = 8
TOPK = 64


@pytest.fixture(params=[64, 1024], ids=["tile64", "tile1024"])
def live_tile_n(request, monkeypatch):
    """Each CPU copy case with one-block tiles (many strided iterations) and the default tile."""
    monkeypatch.setattr(live, "TILE_N", request.param)
    return request.param


def expected_copy(src, dst, lengths, row_start):
    """Torch reference of the copy: the live 64-column blocks of every row of ``src``."""
    expected = dst.clone()
    width = dst.shape[1]
    for r in range(src.shape[0]):
        length = int(lengths.reshape(-1)[row_start + r])
        end = min(width, -(-min(max(length, 0), width) // 64) * 64)
        expected[row_start + r, :end] = src[r, :end]
    return expected


def assert_bits_equal(actual, expected):
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def padded_source(rows, width, device, generator, pad=256):
    """A DeepGEMM-like logits chunk: a view of ``[rows, align(width, 256)]``, random values."""
    aligned = -(-width // pad) * pad
    storage = torch.randn(rows, aligned, generator=generator).to(device)
    return storage[:, :width]


def poisoned(rows, width, device):
    return torch.full((rows, width), POISON, dtype=torch.float32, device=device)


# ------------------------------------------------------------------------------------------------
# CPU (Triton interpreter): runs in CI
# ------------------------------------------------------------------------------------------------


COPY_CASES = [
    pytest.param([0, 1, 63, 64, 65], 320, 0, id="block-edges"),
    pytest.param([127, 128, 129, 320, 5000], 320, 3, id="width-and-past-width"),
    pytest.param([-7, 0, 208, 200, 17], 208, 1, id="negative-and-width-not-a-multiple-of-64"),
]


@pytest.mark.parametrize("lengths,width,row_start", COPY_CASES)
@pytest.mark.parametrize("budget", [1, 7, None], ids=["budget-1", "budget-7", "budget-default"])
@pytest.mark.parametrize("lengths_2d", [False, True], ids=["lengths-n", "lengths-n-by-1"])
def test_copy_writes_exactly_the_live_blocks_of_each_row(
    lengths, width, row_start, budget, lengths_2d, live_tile_n
):
    gen = torch.Generator().manual_seed(len(lengths) * width + row_start)
    rows = len(lengths)
    src = padded_source(rows, width, CPU, gen)
    dst = poisoned(row_start + rows + 2, width, CPU)
    all_lengths = [9999] * row_start + lengths + [9999, 9999]
    lengths_t = torch.tensor(all_lengths, dtype=torch.int32)
    if lengths_2d:
        lengths_t = lengths_t.view(-1, 1)
    expected = expected_copy(src, dst, lengths_t, row_start)
    live.copy_live_logits(src, dst, lengths_t, row_start=row_start, budget=budget)
    assert_bits_equal(dst, expected)


@pytest.mark.quick
def test_a_one_row_source_with_a_unit_row_stride_is_copied():
    """PyTorch's DLPack export gives DeepGEMM's one-row outputs a row stride of 1."""
    src = torch.arange(128, dtype=torch.float32).as_strided((1, 128), (1, 1))
    dst = poisoned(3, 128, CPU)
    lengths = torch.tensor([0, 0, 70], dtype=torch.int32)
    expected = expected_copy(src, dst, lengths, 2)
    live.copy_live_logits(src, dst, lengths, row_start=2)
    assert_bits_equal(dst, expected)


def test_no_rows_writes_nothing():
    dst = poisoned(2, 64, CPU)
    live.copy_live_logits(
        torch.empty(0, 64), dst, torch.zeros(2, dtype=torch.int32), row_start=2, budget=None
    )
    assert torch.isnan(dst).all()


def test_the_grid_depends_only_on_rows_width_and_budget():
    assert live.live_num_splits(132, WIDTH_1M, 1056) == 8
    assert live.live_num_splits(3, WIDTH_1M, 1056) == live.MAX_SPLITS_PER_ROW
    assert live.live_num_splits(132, 1024, 1056) == 1
    assert live.live_num_splits(500, WIDTH_1M, 64) == 1


BAD_COPY_ARGS = [
    (dict(src=torch.zeros(2, 64, dtype=torch.float16)), TypeError, "src"),
    (dict(dst=torch.zeros(4, 128)), ValueError, "dst"),
    (dict(src=torch.zeros(64, 2).t()), ValueError, "src"),
    (dict(src=torch.zeros(2, 72)[:, :70], dst=torch.zeros(4, 70)), ValueError, "row stride"),
    (dict(src=torch.zeros(2, 48), dst=torch.zeros(4, 48)[:, :40]), ValueError, "dst"),
    (dict(lengths=torch.zeros(4, dtype=torch.int64)), TypeError, "lengths"),
    (dict(lengths=torch.zeros(4, 2, dtype=torch.int32)), ValueError, "lengths"),
    (dict(lengths=torch.zeros(1, dtype=torch.int32)), ValueError, "lengths"),
    (dict(row_start=3), ValueError, "row_start"),
    (dict(budget=0), ValueError, "budget"),
    (dict(src=torch.zeros(2, 64)[:, :40], dst=torch.zeros(4, 48)[:, :40]), ValueError, "width"),
]


@pytest.mark.parametrize("overrides,error,name", BAD_COPY_ARGS)
def test_bad_arguments_raise_naming_them(overrides, error, name):
    args = dict(
        src=torch.zeros(2, 64),
        dst=torch.zeros(4, 64),
        lengths=torch.zeros(4, dtype=torch.int32),
        row_start=0,
        budget=None,
    )
    args.update(overrides)
    src, dst, lengths = args.pop("src"), args.pop("dst"), args.pop("lengths")
    with pytest.raises(error, match=name):
        live.copy_live_logits(src, dst, lengths, **args)


def test_the_chunked_logits_take_one_token_per_row():
    case = cases.make_paged_mqa_case(
        [64, 64], width=128, heads=2, device=CPU, generator=torch.Generator().manual_seed(0)
    )
    with pytest.raises(ValueError, match="q must be"):
        live.chunked_paged_mqa_logits_live(
            cases.torch_paged_mqa_logits,
            cases.schedule_stand_in,
            case.q.view(1, 2, *case.q.shape[1:]),
            case.kv_cache,
            case.weights,
            case.context_lens,
            case.block_table,
            case.max_len,
            chunk_rows=1,
            block_kv=64,
        )


ROWS_AROUND_THE_SM_COUNT = [
    pytest.param(CPU_SM_COUNT - 1, id="below-sm-count"),
    pytest.param(CPU_SM_COUNT, id="at-sm-count"),
    pytest.param(CPU_SM_COUNT + 1, id="one-above"),
    pytest.param(3 * CPU_SM_COUNT + 2, id="four-chunks"),
]


@pytest.mark.parametrize("rows", ROWS_AROUND_THE_SM_COUNT)
@pytest.mark.parametrize(
    "init,local", [(0, 0), (2, 3)], ids=["no-token-masks", "init-and-local-tokens"]
)
def test_chunked_live_logits_select_sglang_top_k_indices(rows, init, local):
    """SGLang's masking and top-k after our logits select what they select after SGLang's concat;
    the live columns are the chunks', bit for bit, and nothing past them is written."""
    gen = torch.Generator().manual_seed(rows * 10 + init)
    lengths = cases.edge_lengths(rows, SMALL_WIDTH)
    case = cases.make_paged_mqa_case(
        lengths, width=SMALL_WIDTH, heads=CPU_HEADS, device=CPU, generator=gen
    )
    stock = cases.stock_logits(case, CPU_SM_COUNT)
    ours = cases.live_logits(case, CPU_SM_COUNT, out=poisoned(rows, SMALL_WIDTH, CPU))
    assert cases.live_mismatches(ours, stock, case.lengths) == []
    live_end = [min(SMALL_WIDTH, -(-n // 64) * 64) for n in lengths]
    assert all(torch.isnan(ours[r, end:]).all() for r, end in enumerate(live_end))
    masks = dict(num_init_tokens=init, num_local_tokens=local)
    expected = cases.sglang_topk(stock, case.lengths, TOPK, **masks)
    assert torch.equal(cases.sglang_topk(ours, case.lengths, TOPK, **masks), expected)


def test_the_live_copy_is_the_chunks_whatever_the_chunk_count():
    """Rows past a chunk boundary land in their own output rows (chunk count 1 to 5)."""
    gen = torch.Generator().manual_seed(5)
    lengths = [64 * (r + 1) for r in range(10)]
    case = cases.make_paged_mqa_case(lengths, width=640, heads=2, device=CPU, generator=gen)
    stock = cases.stock_logits(case, case.rows)
    for sm_count in (2, 3, 10):
        ours = cases.live_logits(case, sm_count, budget=3)
        assert cases.live_mismatches(ours, stock, case.lengths) == [], f"sm_count {sm_count}"


def test_mismatches_are_found_in_live_columns_only():
    """The comparison the tests rely on: a flipped live bit is found, a dead column is ignored."""
    stock = torch.zeros(2, 128)
    ours = stock.clone()
    lengths = torch.tensor([65, 10])
    ours[1, 64:] = 1.0  # past row 1's live block
    assert cases.live_mismatches(ours, stock, lengths) == []
    ours[0, 127] = 1.0  # inside row 0's second live block
    assert cases.live_mismatches(ours, stock, lengths) == [0]


def test_the_benchmark_checks_its_arms_in_a_dry_run(capsys):
    bench = (
        Path(__file__).parents[3] / "kernels/benchmark/attention/bench_dsa_indexer_live_logits.py"
    )
    assert runpy.run_path(str(bench))["main"](["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| 9 | 200 | 3 |" in out and "projected saving per round" in out


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def compiled_variants() -> int:
    """Compiled variants of the copy kernel on the current device (Triton's per-device cache)."""
    return len(live._copy_live_logits_kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.gpu
def test_gpu_copy_at_1m_width_matches_the_torch_reference_on_poisoned_buffers():
    gen = torch.Generator().manual_seed(1)
    lengths = cases.edge_lengths(133, WIDTH_1M) + [WIDTH_1M - 5, 70_000, 524_289]
    rows = len(lengths)
    src = padded_source(rows, WIDTH_1M, "cuda", gen)
    dst = poisoned(rows + 3, WIDTH_1M, "cuda")
    lengths_t = torch.tensor(lengths + [1, 2, 3], dtype=torch.int32, device="cuda").view(-1, 1)
    for row_start, budget in ((0, None), (3, 1), (2, rows * 3 + 1)):
        dst.fill_(POISON)
        view = src[: rows - row_start]
        expected = expected_copy(view, dst, lengths_t, row_start)
        live.copy_live_logits(view, dst, lengths_t, row_start=row_start, budget=budget)
        assert_bits_equal(dst, expected)


RANDOM_COPY_WIDTHS = (64, 1008, 2064, 8256, 65_600, WIDTH_1M, WIDTH_1M)  # multiples of 16


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
def test_gpu_copy_matches_the_torch_reference_on_random_cases_at_every_budget(seed):
    """Seeded random copies: rows around and past the SM count, widths up to 1M, a row offset,
    lengths at the block edges, negative and past the width, at budgets 1, rows - 1, rows,
    3 x rows + 1, the default and above it."""
    gen = torch.Generator().manual_seed(seed)
    width = RANDOM_COPY_WIDTHS[seed % len(RANDOM_COPY_WIDTHS)]
    rows = int(torch.randint(1, 300 if width < WIDTH_1M else 140, (1,), generator=gen))
    row_start = int(torch.randint(0, 4, (1,), generator=gen))
    edges = cases.edge_lengths(rows, width)
    random = torch.randint(-3, width + 70, (rows,), generator=gen).tolist()
    pick = torch.randint(0, 2, (rows,), generator=gen).tolist()
    lengths = [e if p else r for e, r, p in zip(edges, random, pick)]
    lengths = torch.tensor([7] * row_start + lengths, dtype=torch.int32, device="cuda")
    src = padded_source(rows, width, "cuda", gen)
    dst = poisoned(row_start + rows + 2, width, "cuda")
    expected = expected_copy(src, dst, lengths, row_start)
    default = default_budget(dst.device, live.PROGRAMS_PER_SM)
    for budget in sorted({1, max(1, rows - 1), rows, 3 * rows + 1, 2 * default + 1}) + [None]:
        dst.fill_(POISON)
        live.copy_live_logits(src, dst, lengths, row_start=row_start, budget=budget)
        assert torch.equal(
            dst.view(torch.int32), expected.view(torch.int32)
        ), f"rows {rows}, width {width}, row_start {row_start}, budget {budget}"


@pytest.mark.gpu
def test_gpu_copy_addresses_rows_past_int32_offsets():
    """Output rows starting past 2**31 elements need int64 addressing."""
    rows_total = 2**31 // WIDTH_1M + 3
    dst = torch.empty((rows_total, WIDTH_1M), dtype=torch.float32, device="cuda")
    assert (rows_total - 1) * WIDTH_1M > 2**31
    src = padded_source(3, WIDTH_1M, "cuda", torch.Generator().manual_seed(2))
    lengths = torch.zeros(rows_total, dtype=torch.int32, device="cuda")
    lengths[-3:] = torch.tensor([WIDTH_1M, 129, 1_000_000], dtype=torch.int32)
    tail = dst[-3:]
    tail.fill_(POISON)
    expected = expected_copy(src, tail, lengths[-3:], 0)
    live.copy_live_logits(src, dst, lengths, row_start=rows_total - 3)
    assert_bits_equal(tail, expected)


@pytest.mark.gpu
def test_gpu_warm_up_compiles_the_only_variant_real_calls_use():
    """After warm_up, calls of every shape the indexer makes use its one compiled variant."""
    device = torch.device("cuda", torch.cuda.current_device())
    live.warm_up(device)
    assert live.is_warm(device)
    gen = torch.Generator().manual_seed(3)
    for rows, width, row_start in ((132, WIDTH_1M, 0), (1, WIDTH_1M, 264), (108, 8256, 132)):
        src = padded_source(rows, width, "cuda", gen)
        dst = torch.empty((row_start + rows, width), device="cuda")
        lengths = torch.full(
            (row_start + rows + 1, 1), width // 3, dtype=torch.int32, device="cuda"
        )
        live.copy_live_logits(src, dst, lengths, row_start=row_start)
        one_row = src[:1].as_strided((1, width), (1, 1))  # DLPack's one-row stride
        # lengths[1:] starts 4 bytes into its buffer: the kernel must not specialise on it.
        live.copy_live_logits(one_row, dst, lengths[1:], row_start=row_start + rows - 1)
    torch.cuda.synchronize()
    assert compiled_variants() == 1


def gpu_sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


GPU_WIDTH = 8256  # 129 pages: past 2049 and not a power of two


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra_rows", [-1, 0, 1, 133], ids=["below", "at", "one-above", "3-chunks"]
)
def test_gpu_chunked_live_logits_select_sglang_top_k_indices(extra_rows):
    sm_count = gpu_sm_count()
    rows = sm_count + extra_rows
    gen = torch.Generator().manual_seed(rows)
    lengths = cases.edge_lengths(rows, GPU_WIDTH)
    case = cases.make_paged_mqa_case(
        lengths, width=GPU_WIDTH, heads=64, device="cuda", generator=gen
    )
    stock = cases.stock_logits(case, sm_count)
    ours = cases.live_logits(case, sm_count, out=poisoned(rows, GPU_WIDTH, "cuda"))
    assert cases.live_mismatches(ours, stock, case.lengths) == []
    masks = dict(num_init_tokens=2, num_local_tokens=3)
    expected = cases.sglang_topk(stock, case.lengths, 2048, **masks)
    assert torch.equal(cases.sglang_topk(ours, case.lengths, 2048, **masks), expected)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_select_sglang_top_k_with_new_lengths():
    """Capture SGLang's path and ours once each (logits, masking, top-k); replay both with growing,
    shrinking, zero and full-width lengths: the same top-k indices and live logits every time."""
    sm_count = gpu_sm_count()
    rows = 2 * sm_count + 5
    gen = torch.Generator().manual_seed(7)
    case = cases.make_paged_mqa_case(
        [1000] * rows, width=GPU_WIDTH, heads=64, device="cuda", generator=gen
    )
    live.warm_up(torch.device("cuda"))
    masks = dict(num_init_tokens=2, num_local_tokens=3)

    def arm(logits_of):
        def body():
            logits = logits_of(case, sm_count)
            return logits, cases.sglang_topk(logits, case.lengths, 2048, **masks)

        return capture_graph(body, warmups=2)

    stock_graph, (stock_logits, stock_topk) = arm(cases.stock_logits)
    live_graph, (live_logits, live_topk) = arm(cases.live_logits)
    rounds = [
        cases.edge_lengths(rows, GPU_WIDTH),
        [GPU_WIDTH] * rows,
        [0] * rows,
        [(r * 997) % (GPU_WIDTH + 1) for r in range(rows)],
        [1] * rows,
    ]
    for lengths in rounds:
        case.set_lengths(lengths)
        stock_graph.replay()
        live_graph.replay()
        torch.cuda.synchronize()
        # Both arms' logits went through the same in-place masking before their top-k.
        assert torch.equal(live_topk, stock_topk), f"top-k differs for lengths {lengths[:8]}..."
        assert cases.live_mismatches(live_logits, stock_logits, case.lengths) == []
