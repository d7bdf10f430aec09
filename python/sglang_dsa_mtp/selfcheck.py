"""Kernel self-checks run by ``python -m sglang_dsa_mtp``: ours against SGLang 0.5.23's own.

Each :class:`SelfCheck` compares one of our kernels with SGLang's on random inputs, bit for bit, on
the device it is given: the GPU (at real sizes, with a timing of each arm from
:func:`cuda_graph_time_us`) or the CPU through Triton's interpreter (at small sizes, untimed). A kernel
joins the self-check by adding its row to ``CHECKS``.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str
    ours_us: float | None = None
    sglang_us: float | None = None


@dataclass(frozen=True)
class SelfCheck:
    name: str
    fn: Callable[[torch.device], CheckResult]


def run_checks(device: torch.device) -> list[tuple[SelfCheck, CheckResult]]:
    """Run every check in ``CHECKS`` on ``device``; a check that raises is a failed check."""
    results = []
    for check in CHECKS:
        try:
            result = check.fn(device)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            result = CheckResult(False, f"raised {type(exc).__name__}: {exc}")
        results.append((check, result))
    return results


def cuda_graph_time_us(
    fn: Callable[[], object], *, calls: int = 20, replays: int = 30, cold_l2: bool = False
) -> float:
    """Microseconds per call of ``fn``, replayed from a CUDA graph on the current CUDA device.

    ``calls`` back-to-back calls are captured in one graph, the graph is replayed ``replays`` times,
    each replay timed between two CUDA events, and the median replay is divided by ``calls``. With
    ``cold_l2`` every call is preceded by a 256 MiB memset, and a graph of the memsets alone, timed
    the same way, is subtracted: each call starts with a cold L2 cache.
    """
    if calls < 1 or replays < 1:
        raise ValueError(
            f"calls and replays must be at least 1, got calls={calls}, replays={replays}"
        )
    if not cold_l2:
        return _median_replay_us(lambda: [fn() for _ in range(calls)], replays) / calls
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def flushed_calls():
        for _ in range(calls):
            flush.zero_()
            fn()

    flushes_only = _median_replay_us(lambda: [flush.zero_() for _ in range(calls)], replays)
    return (_median_replay_us(flushed_calls, replays) - flushes_only) / calls


def _median_replay_us(body: Callable[[], object], replays: int) -> float:
    graph, _ = capture_graph(body)
    graph.replay()
    return statistics.median(replay_us(graph) for _ in range(replays))


def capture_graph(
    body: Callable[[], object], *, warmups: int = 1, capture_error_mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of one call of ``body``, and what that captured call returned.

    ``body`` first runs ``warmups`` times eagerly on a side stream (Triton compiles there, cuBLAS
    and communicators warm up; capture wants work off the default stream), then is captured.
    ``capture_error_mode`` is ``torch.cuda.graph``'s."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        result = body()
    return graph, result


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds of one replay of ``graph``, between two CUDA events on the current stream."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def _bounded_replay_metadata(device: torch.device) -> CheckResult:
    """The three bounded replay-metadata kernels against SGLang's, whole poisoned buffers."""
    from sglang_dsa_mtp.reference_cases import OPS, make_case

    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        width, bs = 1_048_640, 16  # SGLang's default 1M-token table
    else:
        width, bs = 300, 3
    req_to_token = torch.randint(0, 1 << 30, (2 * bs, width), dtype=torch.int32, generator=gen)
    req_to_token = req_to_token.to(device)
    ours_us = sglang_us = 0.0
    for op in OPS:
        lengths = torch.randint(0, width - 8, (bs,), generator=gen).tolist()
        case = make_case(
            op,
            lengths,
            width=width,
            device=device,
            next_n=5,
            req_to_token=req_to_token,
            generator=gen,
        )
        expected, actual = case.run("sglang", case.outputs()), case.run("bounded", case.outputs())
        differing = [
            name
            for name, t in expected.items()
            if t is not None and not torch.equal(t, actual[name])
        ]
        if differing:
            return CheckResult(False, f"{op}: {', '.join(differing)} differ from SGLang's")
        if device.type == "cuda":
            ours_us += cuda_graph_time_us(lambda: case.run("bounded", actual))
            sglang_us += cuda_graph_time_us(lambda: case.run("sglang", expected))
    detail = (
        f"decode + verify + draft extend, bs {bs}, width {width}, random lengths: bit-identical"
    )
    if device.type != "cuda":
        return CheckResult(True, detail)
    return CheckResult(True, detail + " (times: the three ops together)", ours_us, sglang_us)


def _draft_decode_metadata(device: torch.device) -> CheckResult:
    """One launch into 3 draft step backends' buffers vs SGLang's decode kernel run into each one's
    own poisoned buffers, whole buffers; on the GPU timed against the stock precompute + copies."""
    from sglang_dsa_mtp.reference_cases import (
        WIDTH_1M,
        make_case,
        run_draft_decode_multi,
        run_stock_draft_decode,
    )

    steps = 3
    gen = torch.Generator().manual_seed(1)
    if device.type == "cuda":
        width, bs = WIDTH_1M, 16
    else:
        width, bs = 300, 3
    lengths = torch.randint(0, width + 1, (bs,), generator=gen).tolist()
    case = make_case("decode", lengths, width=width, device=device, pool_rows=2 * bs, generator=gen)
    ours = run_draft_decode_multi(case, [case.outputs() for _ in range(steps)])
    for i, out in enumerate(ours):
        expected = case.run("sglang", case.outputs())
        differing = [
            name for name, t in expected.items() if t is not None and not torch.equal(t, out[name])
        ]
        if differing:
            return CheckResult(
                False, f"step backend {i}: {', '.join(differing)} differ from SGLang's"
            )
    detail = (
        f"{steps} step backends, bs {bs}, width {width}, random lengths: each bit-identical to "
        "SGLang's decode kernel"
    )
    if device.type != "cuda":
        return CheckResult(True, detail)
    stock = [case.outputs() for _ in range(steps)]
    ours_us = cuda_graph_time_us(lambda: run_draft_decode_multi(case, ours))
    stock_us = cuda_graph_time_us(lambda: run_stock_draft_decode(case, stock))
    return CheckResult(
        True, detail + " (SGLang time: its decode kernel + copies)", ours_us, stock_us
    )


def _draft_argmax_exchange(device: torch.device) -> CheckResult:
    """Draft argmax partials of emulated TP 2 / 4 / 8 ranks, summed in several orders, finalized
    with both NaN policies vs SGLang's gathered pick (``draft_topk1_postprocess``, ``torch.argmax``)
    on bf16 logits with tie / NaN / inf rows; on the GPU timed at TP 4 against the postprocess."""
    from sglang_dsa_mtp import draft_argmax_cases as cases
    from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as dap
    from sglang_dsa_mtp.reference import topk1_module

    gen = torch.Generator().manual_seed(2)
    vocab, rows = (cases.VOCAB, 16) if device.type == "cuda" else (20011, 4)
    for tp in (2, 4, 8):
        width = cases.padded_shard_width(vocab, tp)
        logits, names = cases.make_logits(
            rows, tp, width, vocab, dtype=torch.bfloat16, generator=gen, first_pattern=tp
        )
        logits = logits.to(device)
        buffers = cases.rank_buffers(logits, tp, vocab)
        problems = cases.slot_violations(buffers, vocab)
        sums = [cases.sum_buffers(buffers, order) for order in cases.sum_orders(tp, gen)]
        if not all(torch.equal(sums[0], other) for other in sums[1:]):
            problems.append("the summed exchange depends on the order of the ranks")
        for policy in dap.NAN_POLICIES:
            problems += cases.check_pick(sums[0], logits, vocab, policy, names=names)
        if problems:
            return CheckResult(False, f"TP {tp}: {problems[0]}")
    detail = (
        f"TP 2/4/8 emulated, vocab {vocab}, rows {rows}, bf16 with tie / NaN / inf rows, both NaN "
        "policies: bit-identical to the gathered pick"
    )
    if device.type != "cuda":
        return CheckResult(True, detail)
    tp = 4
    width = cases.padded_shard_width(vocab, tp)
    logits = cases.make_logits(rows, tp, width, vocab, dtype=torch.bfloat16, generator=gen)[0]
    logits = logits.to(device)
    shard = logits[:, :width].contiguous()
    exchange = cases.sum_buffers(cases.rank_buffers(logits, tp, vocab))
    out = torch.empty_like(exchange)
    gathered = logits[:, :vocab].float()
    positions, draft_tokens = cases.pick_state(rows, device)
    postprocess = topk1_module().draft_topk1_postprocess

    def ours():
        dap.draft_argmax_partials(shard, tp_rank=0, tp_size=tp, vocab_size=vocab, out=out)
        dap.draft_argmax_finalize(exchange, positions, draft_tokens, 1)

    ours_us = cuda_graph_time_us(ours)
    sglang_us = cuda_graph_time_us(lambda: postprocess(gathered, positions, draft_tokens, 1))
    return CheckResult(
        True,
        detail + " (times at TP 4: one rank's partials + finalize vs draft_topk1_postprocess on "
        "the gathered fp32 logits, communication not included)",
        ours_us,
        sglang_us,
    )


CHECKS: tuple[SelfCheck, ...] = (
    SelfCheck("bounded DSA replay metadata", _bounded_replay_metadata),
    SelfCheck("one-launch MTP draft decode metadata", _draft_decode_metadata),
    SelfCheck("draft argmax partials + finalize", _draft_argmax_exchange),
)
