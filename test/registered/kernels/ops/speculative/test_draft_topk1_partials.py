"""Draft argmax partials + a summed exchange + finalize vs SGLang 0.5.23's gathered greedy pick.

A TP group of 2, 3, 4 or 8 ranks is emulated on one device: each rank's ``draft_argmax_partials``
runs on its slice of global logits, the buffers are summed in several orders (as a sum all-reduce
would), and ``draft_argmax_finalize`` must give what the gathered path gives on the same logits:
``[:, :vocab_size]`` as fp32 through SGLang's own ``draft_topk1_postprocess`` (loaded from its file,
``nan_policy="sanitize"``) or through ``torch.argmax`` (``"propagate"``): tokens, topk_p, positions
and the draft-token buffer, compared whole (draft tokens start poisoned).

The rows carry ``argmax_cases.PATTERNS`` (ties inside a split / across splits / across ranks,
NaN before and after the maximum, all-NaN, +inf, all -inf, -0.0 vs +0.0, fp32 -1e30 and its
neighbours vs NaN, ...) over random values, and the vocab padding holds +inf / NaN / 1e30. The GPU
tests add ``argmax_cases.COMPILED_ONLY_PATTERNS`` (bf16 subnormals against zeros and one another),
which Triton's interpreter converts wrongly: the CPU skips them, saying so.

CPU (Triton interpreter, in CI): small odd vocabularies with small splits (``SPLIT_N`` patched to 8,
16 or 64, so that every shard spans several splits and some splits or whole ranks are padding), plus
the real vocab 154880 at the default split. GPU: vocab 154880 at every TP size, rows 1..16, bf16 and
fp32, and a CUDA-graph capture replayed with new logits.
"""

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support import argmax_cases as cases
from support.constants import POISON
from support.reference import topk1_module
from support.timing import capture_graph

CPU = torch.device("cpu")
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
TP_SIZES = [2, 3, 4, 8]
# Row counts of the chunks one case is cut into: together they carry every pattern once.
ROW_CHUNKS = (1, 4, 18)
assert sum(ROW_CHUNKS) >= len(cases.ALL_PATTERNS)


@pytest.fixture
def split_n(request, monkeypatch):
    """Patch the partials' split width (default: leave SPLIT_N as it is)."""
    value = getattr(request, "param", None)
    if value is not None:
        monkeypatch.setattr(dap, "SPLIT_N", value)
    return dap.SPLIT_N


def check_case(logits, names, tp_size, vocab_size, *, seed=0, contiguous=False):
    """Partials per emulated rank, every sum order, both policies: returns the problems found."""
    device = logits.device
    gen = torch.Generator().manual_seed(seed)
    buffers = cases.rank_buffers(logits, tp_size, vocab_size, contiguous=contiguous)
    problems = cases.slot_violations(buffers, vocab_size)
    if logits.dtype == torch.bfloat16:
        # The bf16 kernel's exchange against the fp32 kernel's on the same values (bf16 -> fp32
        # is exact): every lane of every rank's buffer, bit for bit.
        widened = cases.rank_buffers(logits.float(), tp_size, vocab_size, contiguous=contiguous)
        for rank, (ours, floats) in enumerate(zip(buffers, widened)):
            if not torch.equal(ours.view(torch.int32), floats.view(torch.int32)):
                problems.append(f"rank {rank}: the bf16 exchange differs from the fp32 kernel's")
    shape = dap.exchange_shape(logits.shape[0], logits.shape[1] // tp_size, tp_size)
    for buf in buffers:
        if tuple(buf.shape) != shape or buf.dtype != torch.float32 or buf.device != device:
            problems.append(f"exchange buffer {tuple(buf.shape)} {buf.dtype}, expected {shape}")
    sums = [cases.sum_buffers(buffers, order) for order in cases.sum_orders(tp_size, gen)]
    if not all(torch.equal(sums[0], other) for other in sums[1:]):
        problems.append("the sum depends on the order of the ranks")
    for policy in dap.NAN_POLICIES:
        problems += cases.check_pick(sums[0], logits, vocab_size, policy, names=names)
    return problems


def check_chunks(
    tp_size,
    shard_width,
    vocab_size,
    dtype,
    device,
    *,
    seed,
    chunks=ROW_CHUNKS,
    patterns=cases.PATTERNS,
):
    """One case per row chunk; the chunks together carry every row pattern of ``patterns``."""
    gen = torch.Generator().manual_seed(seed)
    problems, first = [], 0
    for rows in chunks:
        logits, names = cases.make_logits(
            rows,
            tp_size,
            shard_width,
            vocab_size,
            dtype=dtype,
            generator=gen,
            first_pattern=first,
            patterns=patterns,
        )
        found = check_case(logits.to(device), names, tp_size, vocab_size, seed=seed + rows)
        problems += [f"rows {rows}: {p}" for p in found]
        first += rows
    return problems


# ------------------------------------------------------------------------------------------------
# CPU (Triton interpreter): runs in CI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_n", [16], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_summed_partials_match_the_gathered_pick(tp_size, dtype, split_n):
    # 40 columns a rank: 3 splits of 16, the last one short; an odd vocab ends inside the last
    # rank's first split, so its other splits are all padding.
    shard_width = 40
    vocab_size = (tp_size - 1) * shard_width + 11
    problems = check_chunks(tp_size, shard_width, vocab_size, dtype, CPU, seed=tp_size)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "tp_size,shard_width,vocab_size,split_n",
    [
        pytest.param(4, 48, 2 * 48 + 5, 16, id="tp4-two-padding-splits-and-a-padding-rank"),
        pytest.param(3, 24, 3 * 24, 8, id="tp3-no-padding"),
        pytest.param(2, 33, 34, 64, id="tp2-one-valid-column-in-rank-1"),
        pytest.param(8, 5, 37, 8, id="tp8-narrow-shards-one-split"),
        # Whole runs of 8 (one load mask per run) with padding: rank 2 holds one valid run of its
        # first split, rank 3 none, and every padding column holds +inf / NaN / 1e30.
        pytest.param(4, 48, 2 * 48 + 8, 16, id="tp4-whole-runs-with-padding-splits"),
    ],
    indirect=["split_n"],
)
def test_padding_layouts(tp_size, shard_width, vocab_size, split_n):
    problems = check_chunks(tp_size, shard_width, vocab_size, torch.bfloat16, CPU, seed=3)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("tp_size,rows", [(2, 3), (8, 2)])
def test_real_vocab_at_the_default_split(tp_size, rows):
    width = cases.padded_shard_width(cases.VOCAB, tp_size)
    assert dap.splits_per_rank(width) > 1
    gen = torch.Generator().manual_seed(tp_size)
    logits, names = cases.make_logits(
        rows, tp_size, width, cases.VOCAB, dtype=torch.bfloat16, generator=gen, first_pattern=1
    )
    problems = check_case(logits, names, tp_size, cases.VOCAB)
    assert not problems, "\n".join(problems)


@pytest.mark.quick
@pytest.mark.parametrize("split_n", [16], indirect=True)
def test_contiguous_and_column_strided_shards(split_n):
    gen = torch.Generator().manual_seed(5)
    logits, names = cases.make_logits(
        6, 3, 40, 100, dtype=torch.float32, generator=gen, first_pattern=3
    )
    assert not check_case(logits, names, 3, 100, contiguous=True)
    # Column stride != 1 (a transposed copy), row stride 1.
    strided = logits.t().contiguous().t()
    assert strided.stride() == (1, 6)
    assert not check_case(strided, names, 3, 100)


@pytest.mark.parametrize("split_n", [16], indirect=True)
def test_patterns_pick_the_tokens_they_are_built_for(split_n):
    """Guards the test data itself: the hard rows really are hard (each rule decides them). In
    fp32, which the interpreter converts right, the bf16 subnormal rows too."""
    tp_size, width, vocab = 4, 40, 151
    rows = len(cases.ALL_PATTERNS)
    logits, names = cases.make_logits(
        rows,
        tp_size,
        width,
        vocab,
        dtype=torch.float32,
        generator=torch.Generator(),
        patterns=cases.ALL_PATTERNS,
    )
    exchange = cases.sum_buffers(cases.rank_buffers(logits, tp_size, vocab))
    sanitize = dap.draft_argmax_finalize(exchange)[1].view(-1).tolist()
    propagate = dap.draft_argmax_finalize(exchange, nan_policy="propagate")[1].view(-1).tolist()
    row = {name: i for i, name in enumerate(names)}
    last = vocab - 1
    expected = {
        "tie-in-split": (1, 1),
        "tie-across-splits": (2, 2),
        "tie-across-ranks": (width - 1, width - 1),
        "nan-before-max": (last // width * width, 1),
        "nan-after-max": (1, width),
        "all-nan": (0, 0),
        "pos-inf-ties": (split_n + 3, split_n + 3),
        "all-neg-inf": (0, 0),
        "neg-inf-and-nan": (width, width),
        "signed-zeros": (2, 2),
        "plus-zero-first": (2, 2),
        "neg-1e30-vs-nan": (1, 1),
        "nan-vs-below-neg-1e30": (last, last),
        "nan-vs-above-neg-1e30": (last, 1),
        "max-at-vocab-end": (last, last),
        "max-at-first-and-last": (0, 0),
        "negative-nan": (width, 1),
        "padding-only-specials": (0, 0),
        "coarse-ties": (1, 1),  # 1 * 7919 % 5 == 4: the first 2.0
        "low-bit-near-ties": (width, width),
        "subnormal-above-zeros": (width, width),  # flushed to zero, +0.0 at column 1 would win
        "subnormal-order": (width, width),
    }
    assert set(expected) | {"random"} == set(cases.ALL_PATTERNS)
    for name, (want_sanitize, want_propagate) in expected.items():
        got = (sanitize[row[name]], propagate[row[name]])
        assert got == (want_sanitize, want_propagate), name


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("column", [0, 3])
def test_positions_advance_and_only_the_draft_token_column_is_written(positions_dtype, column):
    gen = torch.Generator().manual_seed(9)
    logits, names = cases.make_logits(5, 2, 64, 120, dtype=torch.bfloat16, generator=gen)
    exchange = cases.sum_buffers(cases.rank_buffers(logits, 2, 120))
    for policy in dap.NAN_POLICIES:
        problems = cases.check_pick(
            exchange,
            logits,
            120,
            policy,
            draft_token_column=column,
            positions_dtype=positions_dtype,
            names=names,
        )
        assert not problems, problems


def test_strided_positions_and_draft_tokens():
    gen = torch.Generator().manual_seed(10)
    logits, _ = cases.make_logits(4, 2, 64, 128, dtype=torch.float32, generator=gen)
    exchange = cases.sum_buffers(cases.rank_buffers(logits, 2, 128))
    storage = torch.arange(8, dtype=torch.int64) * 10
    positions = storage[::2]  # stride 2
    tokens_storage = torch.full((5, 4), POISON, dtype=torch.int64)
    draft_tokens = tokens_storage.t()  # [4, 5], strides (1, 4)
    _, topk_index = dap.draft_argmax_finalize(exchange, positions, draft_tokens, 2)
    expected = torch.argmax(logits.float(), dim=-1)
    assert torch.equal(topk_index.view(-1), expected)
    assert storage.tolist() == [1, 10, 21, 30, 41, 50, 61, 70]
    want = torch.full((4, 5), POISON, dtype=torch.int64)
    want[:, 2] = expected
    assert torch.equal(draft_tokens, want)


def test_without_positions_or_draft_tokens_only_the_outputs_are_written():
    gen = torch.Generator().manual_seed(11)
    logits, _ = cases.make_logits(3, 2, 64, 100, dtype=torch.bfloat16, generator=gen)
    exchange = cases.sum_buffers(cases.rank_buffers(logits, 2, 100))
    before = exchange.clone()
    topk_p, topk_index = dap.draft_argmax_finalize(exchange)
    ref_p, ref_index = cases.reference_pick(logits, 100, "sanitize")
    assert topk_p.dtype == torch.float32 and topk_p.shape == (3, 1)
    assert topk_index.dtype == torch.int64 and topk_index.shape == (3, 1)
    assert torch.equal(topk_p, ref_p) and torch.equal(topk_index, ref_index)
    assert torch.equal(exchange, before), "finalize reads the exchange only"


def test_finalize_takes_the_3d_view():
    gen = torch.Generator().manual_seed(12)
    logits, _ = cases.make_logits(4, 2, 64, 100, dtype=torch.bfloat16, generator=gen)
    exchange = cases.sum_buffers(cases.rank_buffers(logits, 2, 100))
    flat = dap.draft_argmax_finalize(exchange, nan_policy="propagate")
    view = dap.draft_argmax_finalize(exchange.view(4, -1, dap.LANES), nan_policy="propagate")
    assert all(torch.equal(a, b) for a, b in zip(flat, view))


@pytest.mark.parametrize("split_n", [16], indirect=True)
def test_out_buffer_is_overwritten_whole(split_n):
    """A persistent out= holding garbage (or last step's all-reduced sum) gives the same buffer."""
    gen = torch.Generator().manual_seed(13)
    logits, _ = cases.make_logits(5, 4, 40, 150, dtype=torch.bfloat16, generator=gen)
    fresh = cases.rank_buffers(logits, 4, 150)
    garbage = [torch.full_like(b, float("nan")) for b in fresh]
    garbage[1].copy_(cases.sum_buffers(fresh))  # last step's reduced buffer
    garbage[2].fill_(-0.0)
    reused = cases.rank_buffers(logits, 4, 150, outs=garbage)
    for rank, (a, b) in enumerate(zip(fresh, reused)):
        assert b is garbage[rank]
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), rank


def test_interpreted_kernels_launch_plainly():
    """Programmatic dependent launch is for compiled kernels on a GPU of compute capability 9.0
    or later only (its wait is an instruction the interpreter cannot run)."""
    assert dap.programmatic(CPU) is False


def test_zero_rows():
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    exchange = dap.draft_argmax_partials(empty, tp_rank=0, tp_size=2, vocab_size=100)
    assert exchange.shape == (0, 2 * dap.LANES)
    positions = torch.empty(0, dtype=torch.int64)
    topk_p, topk_index = dap.draft_argmax_finalize(exchange, positions)
    assert topk_p.shape == (0, 1) and topk_index.shape == (0, 1)


def test_exchange_shape_helpers():
    assert dap.splits_per_rank(1) == 1
    assert dap.splits_per_rank(dap.SPLIT_N) == 1
    assert dap.splits_per_rank(dap.SPLIT_N + 1) == 2
    width = cases.padded_shard_width(cases.VOCAB, 2)
    assert width == 77440
    assert dap.exchange_shape(16, width, 2) == (16, 2 * dap.splits_per_rank(width) * dap.LANES)
    assert cases.padded_shard_width(1001, 4) == 256
    assert cases.padded_shard_width(100, 3) == 64  # 128 % 3 != 0: padded to 192


@pytest.mark.parametrize(
    "shard_width,tp_size,vocab_size,whole_runs",
    [
        (cases.padded_shard_width(cases.VOCAB, 8), 8, cases.VOCAB, True),
        (48, 4, 2 * 48 + 8, True),
        (48, 4, 2 * 48 + 5, False),  # the last valid rank ends inside a run
        (44, 2, 80, False),  # a shard ending inside a run
    ],
)
def test_one_load_mask_per_run_the_same_on_every_rank(shard_width, tp_size, vocab_size, whole_runs):
    # The per-run mask is exact only where every valid width is a multiple of RUN_N; the flag is
    # the same on every rank, so that the warm-up (rank 0's layout) compiles what each rank runs.
    layouts = [
        dap.partials_layout(
            shard_width=shard_width, tp_rank=rank, tp_size=tp_size, vocab_size=vocab_size
        )
        for rank in range(tp_size)
    ]
    assert {layout.whole_runs for layout in layouts} == {whole_runs}
    if whole_runs:
        assert all(layout.valid_width % dap.RUN_N == 0 for layout in layouts)
    else:
        assert any(layout.valid_width % dap.RUN_N for layout in layouts) or shard_width % dap.RUN_N


LOGITS = torch.zeros(2, 16, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(logits_shard=LOGITS.float().numpy()), TypeError, "logits_shard"),
        (dict(logits_shard=LOGITS.half()), TypeError, "logits_shard must be bfloat16"),
        (dict(logits_shard=LOGITS.int()), TypeError, "logits_shard"),
        (dict(logits_shard=LOGITS[0]), ValueError, "logits_shard must be 2-D"),
        (dict(logits_shard=LOGITS[:, :0]), ValueError, "at least one column"),
        (dict(tp_rank=2), ValueError, "tp_rank must be < tp_size"),
        (dict(tp_rank=-1), ValueError, "tp_rank must be >= 0"),
        (dict(tp_rank=True), TypeError, "tp_rank must be an int"),
        (dict(tp_size=0, tp_rank=0), ValueError, "tp_size must be >= 1"),
        (dict(tp_size=2.0), TypeError, "tp_size must be an int"),
        (dict(vocab_size=33), ValueError, r"vocab_size \(33\) must be <= tp_size \* shard_width"),
        (dict(vocab_size=0), ValueError, "vocab_size must be >= 1"),
        (dict(vocab_size=None), TypeError, "vocab_size must be an int"),
        (dict(out=torch.zeros(2, 7)), ValueError, "out must have shape"),
        (dict(out=torch.zeros(2, 8, dtype=torch.float64)), TypeError, "out must be float32"),
        (dict(out=[0.0]), TypeError, "out must be a torch.Tensor"),
    ],
)
def test_partials_argument_errors_name_the_argument(kwargs, error, match):
    args = dict(logits_shard=LOGITS, tp_rank=1, tp_size=2, vocab_size=20, out=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dap.draft_argmax_partials(
            args.pop("logits_shard"),
            tp_rank=args["tp_rank"],
            tp_size=args["tp_size"],
            vocab_size=args["vocab_size"],
            out=args["out"],
        )


def test_partials_reject_a_vocab_past_exact_fp32_lanes():
    wide = torch.zeros(1, 1, dtype=torch.bfloat16).expand(1, (1 << 23) + 1)
    with pytest.raises(ValueError, match="vocab_size must be <= 16777216"):
        dap.draft_argmax_partials(wide, tp_rank=0, tp_size=2, vocab_size=(1 << 24) + 1)


EXCHANGE = torch.zeros(3, 2 * dap.LANES)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(exchange=EXCHANGE.double()), TypeError, "exchange must be float32"),
        (dict(exchange=EXCHANGE[:, :7]), ValueError, "exchange must be"),
        (dict(exchange=EXCHANGE[:, :0]), ValueError, "exchange must be"),
        (dict(exchange=EXCHANGE.view(3, 2, 4, 1)), ValueError, "exchange must be"),
        (dict(exchange=EXCHANGE.numpy()), TypeError, "exchange must be a torch.Tensor"),
        (dict(positions=torch.zeros(3)), TypeError, "positions must be int32 or int64"),
        (dict(positions=torch.zeros(4, dtype=torch.int64)), ValueError, "positions must be 1-D"),
        (dict(positions=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "positions must be 1-D"),
        (
            dict(draft_tokens=torch.zeros(3, 2, dtype=torch.int32)),
            TypeError,
            "draft_tokens must be int64",
        ),
        (
            dict(draft_tokens=torch.zeros(2, 2, dtype=torch.int64)),
            ValueError,
            "draft_tokens must be 2-D with rows=3",
        ),
        (
            dict(draft_tokens=torch.zeros(3, 2, dtype=torch.int64), draft_token_column=2),
            ValueError,
            "draft_token_column must be < draft_tokens.shape",
        ),
        (
            dict(draft_tokens=torch.zeros(3, 2, dtype=torch.int64), draft_token_column=-1),
            ValueError,
            "draft_token_column must be >= 0",
        ),
        (dict(nan_policy="ignore"), ValueError, "nan_policy must be one of"),
    ],
)
def test_finalize_argument_errors_name_the_argument(kwargs, error, match):
    args = dict(exchange=EXCHANGE, positions=None, draft_tokens=None, draft_token_column=0)
    policy = kwargs.pop("nan_policy", "sanitize")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dap.draft_argmax_finalize(**args, nan_policy=policy)


@pytest.mark.parametrize("split_n", [8], indirect=True)
def test_warm_up_launches_each_call_site_variant_once(split_n, monkeypatch):
    launches = []
    for name in ("draft_argmax_partials", "draft_argmax_finalize"):
        real = getattr(dap, name)

        def record(*args, _real=real, _name=name, **kwargs):
            launches.append((_name, args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dap, name, record)
    variants = dap.warm_up(
        rows=[4, 2, 8],
        shard_width=24,
        tp_size=2,
        vocab_size=40,
        dtypes=[torch.bfloat16, torch.float32, torch.bfloat16],
        device=CPU,
        draft_steps=3,
    )
    assert variants == (
        "partials bfloat16",
        "partials float32",
        "finalize sanitize, positions and draft tokens",
        "finalize sanitize, positions",
        "finalize propagate",
    )
    partials = [args[0] for name, args, _ in launches if name == "draft_argmax_partials"]
    assert [(p.dtype, tuple(p.shape)) for p in partials] == [
        (torch.bfloat16, (2, 24)),
        (torch.float32, (2, 24)),
    ], "one launch per dtype, at the smallest row count, the shard's width"
    finalize = [
        (args, kwargs) for name, args, kwargs in launches if name == "draft_argmax_finalize"
    ]
    positions, tokens, column = finalize[0][0][1:]
    assert positions.dtype == torch.int64 and positions.shape == (2,)
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 3) and column == 2
    assert len(finalize[1][0]) == 2 and finalize[2][1] == dict(nan_policy="propagate")


def test_warm_up_without_draft_steps_skips_the_draft_token_variant(split_n):
    variants = dap.warm_up(
        rows=[1], shard_width=8, tp_size=2, vocab_size=16, dtypes=[torch.float32], device=CPU
    )
    assert variants == ("partials float32", "finalize sanitize, positions", "finalize propagate")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rows=[]), ValueError, "rows must be a non-empty sequence"),
        (dict(rows=[0, 4]), ValueError, "rows must be a non-empty sequence of ints >= 1"),
        (dict(dtypes=[]), ValueError, "dtypes must be a non-empty choice"),
        (dict(dtypes=[torch.float16]), ValueError, "dtypes must be a non-empty choice"),
        (dict(shard_width=0), ValueError, "shard_width must be >= 1"),
        (dict(draft_steps=0), ValueError, "draft_steps must be >= 1"),
        (dict(vocab_size=33), ValueError, r"vocab_size \(33\) must be <= tp_size"),
    ],
)
def test_warm_up_argument_errors_name_the_argument(kwargs, error, match):
    args = dict(
        rows=[1], shard_width=16, tp_size=2, vocab_size=20, dtypes=[torch.bfloat16], device=CPU
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dap.warm_up(**args)


def test_the_reference_is_sglangs_own_file():
    module = topk1_module()
    assert module.__file__.endswith("sglang/kernels/ops/speculative/topk1.py")
    assert module._DRAFT_TOPK1_BLOCK == 8192


# ------------------------------------------------------------------------------------------------
# GPU: the real vocab at every TP size, rows 1..16, and a CUDA-graph capture; every pattern, the
# bf16 subnormal rows included
# ------------------------------------------------------------------------------------------------

ALL = cases.ALL_PATTERNS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=cases.INTERPRETER_SUBNORMALS)
@pytest.mark.parametrize("split_n", [16], indirect=True)
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_bf16_subnormal_rows_match_the_gathered_pick(tp_size, split_n):
    """The CPU cases' layout (40 columns a rank, 3 splits of 16), with the rows of
    ``COMPILED_ONLY_PATTERNS`` only: bf16 subnormals against +0.0, -0.0 and one another."""
    shard_width = 40
    vocab_size = (tp_size - 1) * shard_width + 11
    chunks = (len(cases.COMPILED_ONLY_PATTERNS),)
    problems = check_chunks(
        tp_size,
        shard_width,
        vocab_size,
        torch.bfloat16,
        "cuda",
        seed=tp_size,
        chunks=chunks,
        patterns=cases.COMPILED_ONLY_PATTERNS,
    )
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_real_vocab_every_row_count_on_gpu(tp_size, dtype):
    width = cases.padded_shard_width(cases.VOCAB, tp_size)
    gen = torch.Generator().manual_seed(100 + tp_size)
    problems = []
    for rows in range(1, 17):
        logits, names = cases.make_logits(
            rows,
            tp_size,
            width,
            cases.VOCAB,
            dtype=dtype,
            generator=gen,
            first_pattern=rows * 5,
            patterns=cases.ALL_PATTERNS,
        )
        found = check_case(logits.cuda(), names, tp_size, cases.VOCAB, seed=rows)
        problems += [f"rows {rows}: {p}" for p in found]
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_size", [1001, 129281, 100_003])
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_padded_vocabs_on_gpu(tp_size, vocab_size):
    width = cases.padded_shard_width(vocab_size, tp_size)
    problems = check_chunks(
        tp_size, width, vocab_size, torch.bfloat16, "cuda", seed=vocab_size, patterns=ALL
    )
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(16))
def test_random_vocabularies_tp_sizes_and_row_counts_on_gpu(seed):
    """Seeded random shapes: TP size, vocab (padded or not to the shard count), dtype and row
    chunks (draft decode rows up to 48, draft extend rows up to 240), every pattern carried."""
    gen = torch.Generator().manual_seed(seed)
    tp_size = TP_SIZES[int(torch.randint(0, len(TP_SIZES), (1,), generator=gen))]
    vocab_size = int(torch.randint(1000, 160_001, (1,), generator=gen))
    dtype = (torch.bfloat16, torch.float32)[seed % 2]
    chunks = (
        int(torch.randint(1, 9, (1,), generator=gen)),
        int(torch.randint(1, 241, (1,), generator=gen)),
        len(ALL),
    )
    width = cases.padded_shard_width(vocab_size, tp_size)
    problems = check_chunks(
        tp_size, width, vocab_size, dtype, "cuda", seed=seed, chunks=chunks, patterns=ALL
    )
    assert not problems, f"TP {tp_size}, vocab {vocab_size}, {dtype}, rows {chunks}: " + "\n".join(
        problems
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tp_size", [2, 8])
def test_emulated_exchange_in_a_cuda_graph(tp_size):
    """Partials of every emulated rank into persistent buffers, their sum, finalize with both
    policies, captured once; each replay with new logits equals the gathered pick."""
    rows, width = 16, cases.padded_shard_width(cases.VOCAB, tp_size)
    static_logits = torch.empty(rows, tp_size * width, dtype=torch.bfloat16, device="cuda")
    outs = [
        torch.empty(dap.exchange_shape(rows, width, tp_size), device="cuda") for _ in range(tp_size)
    ]
    positions, draft_tokens = cases.pick_state(rows, "cuda")

    def body():
        buffers = cases.rank_buffers(static_logits, tp_size, cases.VOCAB, outs=outs)
        exchange = cases.sum_buffers(buffers)
        sanitize = dap.draft_argmax_finalize(exchange, positions, draft_tokens, 2)
        propagate = dap.draft_argmax_finalize(exchange, nan_policy="propagate")
        return sanitize, propagate

    gen = torch.Generator().manual_seed(21)
    static_logits.copy_(
        cases.make_logits(
            rows, tp_size, width, cases.VOCAB, dtype=torch.bfloat16, generator=gen, patterns=ALL
        )[0]
    )
    graph, ((topk_p, topk_index), (prop_p, prop_index)) = capture_graph(body)
    seen = set()
    for replay in range(3):
        logits, names = cases.make_logits(
            rows,
            tp_size,
            width,
            cases.VOCAB,
            dtype=torch.bfloat16,
            generator=gen,
            first_pattern=replay * 7,
            patterns=ALL,
        )
        static_logits.copy_(logits)
        fresh_positions, fresh_tokens = cases.pick_state(rows, "cuda")
        positions.copy_(fresh_positions)
        draft_tokens.copy_(fresh_tokens)
        graph.replay()
        ref_p, ref_index = cases.reference_pick(
            static_logits, cases.VOCAB, "sanitize", fresh_positions, fresh_tokens, 2
        )
        arg_p, arg_index = cases.reference_pick(static_logits, cases.VOCAB, "propagate")
        ours = dict(topk_p=topk_p, topk_index=topk_index, positions=positions)
        want = dict(topk_p=ref_p, topk_index=ref_index, positions=fresh_positions)
        ours.update(draft_tokens=draft_tokens, prop_p=prop_p, prop_index=prop_index)
        want.update(draft_tokens=fresh_tokens, prop_p=arg_p, prop_index=arg_index)
        assert not cases.differences(ours, want), (replay, cases.describe(ours, want, names))
        seen.add(tuple(topk_index.view(-1).tolist()))
    assert len(seen) == 3, "each replay picked from its own logits"
