"""No Triton compile on the serving path: after ``warm_up``, the greedy draft launches compile nothing.

The draft argmax exchange's opt-in (before SGLang captures the draft graphs) runs
``draft_argmax_partials.warm_up`` with the captured batch sizes. Here, on a GPU, with the kernels'
compiled variants forgotten first (as in a fresh server process), ``warm_up`` compiles both kernels,
and then every launch the call sites make for every captured batch size (the partials of every TP
rank per logits dtype; the draft decode finalize with positions and each draft-token column, and
without draft tokens; the draft extend finalize with the ``propagate`` rule on the replay's rows)
compiles nothing, counted through Triton's post-compile hook (``support.compiles``).
The interpreter compiles nothing, so these are GPU tests only.
"""

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
from support.argmax_cases import VOCAB, padded_shard_width
from support.compiles import count_compiles, forget_compiled

# SGLang 0.5.23's draft graph batch sizes with speculative decoding and
# --cuda-graph-max-bs-decode 32 (generate_decode_cuda_graph_batch_sizes).
CAPTURE_BS = list(range(1, 9)) + list(range(10, 33, 2))
KERNELS = (dap._draft_argmax_partials_kernel, dap._draft_argmax_finalize_kernel)
# (TP size, --speculative-num-steps): the spec's TP4 launch (4/1/5) and a TP8 one (3/1/4).
DEPLOYMENTS = [pytest.param(4, 4, id="tp4-steps4"), pytest.param(8, 3, id="tp8-steps3")]
DTYPES = [
    pytest.param((torch.bfloat16,), id="bf16-head"),
    pytest.param((torch.bfloat16, torch.float32), id="bf16-head-fp32-output"),
]


def warm_up(tp_size, draft_steps, dtypes):
    """A fresh process's opt-in: forget what this process compiled, then warm up."""
    forget_compiled(*KERNELS)
    with count_compiles() as warm:
        dap.warm_up(
            rows=CAPTURE_BS,
            shard_width=padded_shard_width(VOCAB, tp_size),
            tp_size=tp_size,
            vocab_size=VOCAB,
            dtypes=dtypes,
            device=torch.device("cuda"),
            draft_steps=draft_steps,
        )
        torch.cuda.synchronize()
    return warm


def serve(rows, tp_size, draft_steps, dtypes, gen):
    """Every launch the call sites make for ``rows`` rows: each rank's partials per logits dtype,
    summed as the all-reduce does; the draft decode finalize (positions and each draft-token
    column, then positions alone); the draft extend finalize on the replay's leading rows."""
    width = padded_shard_width(VOCAB, tp_size)
    for dtype in dtypes:
        exchange = torch.zeros(dap.exchange_shape(rows, width, tp_size), device="cuda")
        for rank in range(tp_size):
            logits = torch.randn(rows, width, generator=gen, device="cuda").to(dtype)
            exchange += dap.draft_argmax_partials(
                logits, tp_rank=rank, tp_size=tp_size, vocab_size=VOCAB
            )
        positions = torch.arange(rows, dtype=torch.int64, device="cuda")
        draft_tokens = torch.zeros((rows, draft_steps), dtype=torch.int64, device="cuda")
        for column in range(1, draft_steps):
            dap.draft_argmax_finalize(exchange, positions, draft_tokens, column)
        dap.draft_argmax_finalize(exchange, positions)
        for raw_rows in sorted({1, max(1, rows - 1), rows}):
            dap.draft_argmax_finalize(exchange[:raw_rows], nan_policy="propagate")


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("tp_size, draft_steps", DEPLOYMENTS)
def test_after_warm_up_every_captured_batch_size_compiles_nothing(tp_size, draft_steps, dtypes):
    warm = warm_up(tp_size, draft_steps, dtypes)
    assert all(warm.of(kernel) >= 1 for kernel in KERNELS), f"warm-up: {warm.describe()}"
    gen = torch.Generator(device="cuda").manual_seed(tp_size)
    with count_compiles() as sweep:
        for rows in CAPTURE_BS:
            serve(rows, tp_size, draft_steps, dtypes, gen)
        torch.cuda.synchronize()
    assert (
        sweep.names == []
    ), f"compiled after the warm-up ({len(warm.names)} compiles): {sweep.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize("tp_size, draft_steps", DEPLOYMENTS)
def test_an_eager_batch_larger_than_any_captured_one_compiles_nothing_either(tp_size, draft_steps):
    """A row count only sizes the grids: one SGLang runs eagerly, past the captured sizes, needs no
    variant the warm-up did not compile."""
    warm_up(tp_size, draft_steps, (torch.bfloat16,))
    gen = torch.Generator(device="cuda").manual_seed(tp_size)
    with count_compiles() as sweep:
        serve(max(CAPTURE_BS) + 5, tp_size, draft_steps, (torch.bfloat16,), gen)
        torch.cuda.synchronize()
    assert sweep.names == [], sweep.describe()


def compiled_variants(kernel) -> list:
    """The variants of ``kernel`` this process compiled (Triton's per-device kernel caches)."""
    return [variant for cache in kernel.device_caches.values() for variant in cache[0].values()]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs a GPU of compute capability 9.0 or later",
)
def test_on_compute_capability_9_both_kernels_launch_as_programmatic_dependents():
    """Every variant the warm-up compiles launches with PDL and waits for the kernel before it."""
    warm_up(4, 4, (torch.bfloat16, torch.float32))
    assert dap.programmatic(torch.device("cuda"))
    for kernel in KERNELS:
        variants = compiled_variants(kernel)
        assert variants, f"no compiled variant of {kernel.__name__}"
        for variant in variants:
            assert variant.metadata.launch_pdl, variant.metadata
            assert "griddepcontrol.wait" in variant.asm["ptx"]
