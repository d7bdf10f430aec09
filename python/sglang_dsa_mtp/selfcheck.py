"""The kernel self-checks of ``python -m sglang_dsa_mtp``: each of our kernels against SGLang's own.

A check runs one of our kernels and SGLang 0.5.23's code it replaces on the same seeded random
inputs (a few hard rows among them), into output buffers filled with :data:`POISON` with spare rows
past the batch, and compares every element. On a CUDA GPU it runs at SGLang's default sizes (a
1M-token table, the GLM-5 vocabulary) and times each arm: the median of CUDA-graph replays, hot L2.
On the CPU it runs at small sizes through Triton's interpreter, untimed; there the two
replay-metadata checks do not run (``needs_cuda``): SGLang's wrappers assert CUDA tensors. The test
suite runs those through the interpreter too, with SGLang's asserts stripped
(``test/registered/test_selfcheck.py``).

Import this module after ``select_device()``: SGLang's kernel modules define Triton kernels, and
Triton reads ``TRITON_INTERPRET`` when it defines one.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft_decode
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.kernels.ops.speculative import draft_argmax_partials as argmax

POISON = -0x2B2B2B2B  # what every output buffer holds before a kernel runs
SPARE = 2  # rows past the batch in every output buffer: no kernel may write them
GPU_WIDTH, CPU_WIDTH = 1_048_640, 300  # req_to_token's width: SGLang's at a 1M context; small
GPU_VOCAB, CPU_VOCAB = 154_880, 20_011  # GLM-5's vocabulary; small (and odd)
PAGE_SIZE, NEXT_N = 64, 5  # SGLang's DSA page size; EAGLE 4/1/5's verify rows per request


@dataclass(frozen=True)
class CheckResult:
    """``ok``, a one-line ``detail``, and on the GPU the microseconds per call of each arm."""

    ok: bool
    detail: str
    ours_us: float | None = None
    sglang_us: float | None = None


@dataclass(frozen=True)
class SelfCheck:
    """One row: ``check`` maps a device to a :class:`CheckResult`; ``needs_cuda``: it runs on a
    CUDA device only."""

    name: str
    check: Callable[[torch.device], CheckResult]
    needs_cuda: bool = False


def run_checks(
    checks: Sequence[SelfCheck], device: torch.device
) -> list[tuple[SelfCheck, CheckResult]]:
    """Run every check on ``device``; a check that raises is a failed check (traceback on stderr)."""
    results = []
    for check in checks:
        try:
            result = check.check(device)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            result = CheckResult(False, f"raised {type(exc).__name__}: {exc}")
        results.append((check, result))
    return results


def graph_time_us(fn: Callable[[], object], replays: int = 50) -> float:
    """Median microseconds of one replay of a CUDA graph holding ``fn`` (run once before capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _passed(device, detail: str, ours: Callable, sglang: Callable, times: str) -> CheckResult:
    """A passed check; on a GPU with each arm timed, ``times`` saying what the times cover."""
    if device.type != "cuda":
        return CheckResult(True, detail)
    return CheckResult(True, f"{detail} ({times})", graph_time_us(ours), graph_time_us(sglang))


def _differing(expected: dict, actual: dict) -> list[str]:
    return [
        name
        for name, want in expected.items()
        if want is not None and not torch.equal(want, actual[name])
    ]


# --- the replay-metadata kernels ------------------------------------------------------------------


def sglang_metadata_kernels():
    """SGLang's module of the replay-metadata kernels ours replace (a test swaps in a copy whose
    CUDA asserts are stripped, to run it on the CPU)."""
    from sglang.kernels.ops.attention.dsa import metadata

    return metadata


class _MetadataCall:
    """One replay-metadata call in SGLang's keyword form, ``op`` one of decode / verify /
    draft_extend: seeded random lengths (0 and the full width among them) and request slots."""

    def __init__(self, op: str, bs: int, width: int, device, gen: torch.Generator):
        self.op, self.bs, self.width, self.device = op, bs, width, device
        lengths = torch.randint(0, width + 1, (bs,), generator=gen)
        lengths[:2] = torch.tensor([0, width])[: min(bs, 2)]
        self.req_to_token = torch.randint(
            0, 1 << 30, (2 * bs, width), dtype=torch.int32, generator=gen
        ).to(device)
        self.inputs = dict(
            seq_lens=lengths.to(device),
            req_pool_indices=torch.randperm(2 * bs, generator=gen)[:bs].to(device),
            req_to_token=self.req_to_token,
            bs=bs,
            dsa_index_topk=2048 if device.type == "cuda" else 200,
            physical_page_size=PAGE_SIZE,
        )
        rows = bs if op == "decode" else bs * NEXT_N
        if op == "decode":
            self.inputs["max_len"] = width
        else:
            self.inputs["max_seqlen_k"] = width
        if op == "verify":
            self.inputs["next_n"] = NEXT_N
        if op == "draft_extend":
            self.inputs.update(
                extend_seq_lens=torch.full((bs,), NEXT_N, dtype=torch.int32, device=device),
                total_len=rows,
                max_extend_len=NEXT_N,
                max_total_len=rows,
                static_extend_len=True,
            )
        self.rows = rows

    def outputs(self) -> dict:
        rows, bs = self.rows + SPARE, self.bs + SPARE

        def poisoned(*shape):
            return torch.full(shape, POISON, dtype=torch.int32, device=self.device)

        out = dict(
            cache_seqlens=poisoned(bs),
            cu_seqlens_k=poisoned(bs + 1),
            page_table_1=poisoned(rows, self.width),
            dsa_cache_seqlens=poisoned(rows),
            dsa_cu_seqlens_k=poisoned(rows + 1),
            real_page_table=poisoned(rows, -(-self.width // PAGE_SIZE)),
        )
        if self.op != "decode":
            out["seqlens_expanded"] = poisoned(rows)
        return out

    def run(self, kernel, out: dict) -> dict:
        kernel(**self.inputs, **out)
        return out


# op: (SGLang's kernel, ours), by their names in SGLang's module and in ``bounded``
_OPS = {
    "decode": ("fused_dsa_decode_metadata", "fused_dsa_decode_metadata_bounded"),
    "verify": ("fused_dsa_target_verify_metadata", "fused_dsa_target_verify_metadata_bounded"),
    "draft_extend": ("fused_dsa_draft_extend_metadata", "fused_dsa_draft_extend_metadata_bounded"),
}


def _sizes(device) -> tuple[int, int]:
    return (GPU_WIDTH, 16) if device.type == "cuda" else (CPU_WIDTH, 3)


def check_bounded_replay_metadata(device: torch.device) -> CheckResult:
    """The three bounded replay-metadata kernels against SGLang's, whole poisoned buffers."""
    sglang = sglang_metadata_kernels()
    gen = torch.Generator().manual_seed(0)
    width, bs = _sizes(device)
    calls = []
    for op, (theirs, ours) in _OPS.items():
        theirs, ours = getattr(sglang, theirs), getattr(bounded, ours)
        call = _MetadataCall(op, bs, width, device, gen)
        expected = call.run(theirs, call.outputs())
        actual = call.run(ours, call.outputs())
        differing = _differing(expected, actual)
        if differing:
            return CheckResult(False, f"{op}: {', '.join(differing)} differ from SGLang's")
        calls.append((call, theirs, ours, expected, actual))
    return _passed(
        device,
        f"decode + verify + draft extend, bs {bs}, width {width}: bit-identical",
        lambda: [call.run(ours, actual) for call, _, ours, _, actual in calls],
        lambda: [call.run(theirs, expected) for call, theirs, _, expected, _ in calls],
        "times: the three together",
    )


def check_draft_decode_metadata(device: torch.device) -> CheckResult:
    """The MTP one launch into 3 draft-step backends' buffers against SGLang's decode kernel run
    into each one's own; on the GPU timed against SGLang's way (its decode kernel into a scratch
    table, then a copy into every step)."""
    steps = 3
    sglang = sglang_metadata_kernels().fused_dsa_decode_metadata
    width, bs = _sizes(device)
    call = _MetadataCall("decode", bs, width, device, torch.Generator().manual_seed(1))
    ours = [call.outputs() for _ in range(steps)]
    multi = dict(call.inputs)
    multi["destinations"] = [draft_decode.DecodeMetadataDestination(**out) for out in ours]
    draft_decode.fused_dsa_draft_decode_metadata_multi(**multi)
    expected = call.run(sglang, call.outputs())
    for i, out in enumerate(ours):
        differing = _differing(expected, out)
        if differing:
            return CheckResult(False, f"step {i}: {', '.join(differing)} differ from SGLang's")
    scratch, stock = call.outputs(), [call.outputs() for _ in range(steps)]
    pairs = [(dst[name], scratch[name]) for dst in stock for name in scratch]

    def stock_way():
        call.run(sglang, scratch)
        torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])

    return _passed(
        device,
        f"{steps} step backends, bs {bs}, width {width}: each bit-identical to SGLang's decode "
        "kernel",
        lambda: draft_decode.fused_dsa_draft_decode_metadata_multi(**multi),
        stock_way,
        "SGLang's time: its kernel into a scratch table, then the copies",
    )


# --- the greedy draft's argmax exchange ------------------------------------------------------------


def sglang_draft_pick():
    """SGLang's greedy draft pick on gathered logits, ``draft_topk1_postprocess``."""
    from sglang.kernels.ops.speculative.topk1 import draft_topk1_postprocess

    return draft_topk1_postprocess


def _hard_logits(rows: int, columns: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 logits whose first rows are the hard cases of the exchange: a tie across the ranks'
    ends, a NaN after the max, all -inf, the max in the last vocab column; padding columns past
    ``vocab`` hold values the pick must never return."""
    logits = torch.randn(rows, columns, generator=gen) * 4
    logits[0, [1, vocab - 1]] = 100.0
    logits[1, 3], logits[1, vocab // 2] = 100.0, float("nan")
    logits[2] = float("-inf")
    logits[3, vocab - 1] = 100.0
    logits[:, vocab:] = float("inf")
    return logits.to(torch.bfloat16)


def check_draft_argmax_exchange(device: torch.device) -> CheckResult:
    """The argmax partials of TP 2 / 4 / 8 emulated ranks, summed as SGLang's all-reduce would, and
    the finalize with both NaN rules, against SGLang's pick on the gathered fp32 logits
    (``draft_topk1_postprocess``; ``torch.argmax`` for the target verify's rule)."""
    gen = torch.Generator().manual_seed(2)
    vocab, rows = (GPU_VOCAB, 16) if device.type == "cuda" else (CPU_VOCAB, 4)
    postprocess = sglang_draft_pick()
    for tp in (2, 4, 8):
        width = -(-vocab // (64 * tp)) * 64  # SGLang's padded vocab shard
        logits = _hard_logits(rows, tp * width, vocab, gen).to(device)
        exchange = sum(
            argmax.draft_argmax_partials(
                logits[:, r * width : (r + 1) * width], tp_rank=r, tp_size=tp, vocab_size=vocab
            )
            for r in range(tp)
        )
        gathered = logits[:, :vocab].float().contiguous()
        positions = torch.arange(rows, device=device) * 7
        ours_positions, sglang_positions = positions.clone(), positions.clone()
        got = (*argmax.draft_argmax_finalize(exchange, ours_positions), ours_positions)
        want = (*postprocess(gathered, sglang_positions, None, 0), sglang_positions)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return CheckResult(False, f"TP {tp}: the draft pick differs from SGLang's")
        got = argmax.draft_argmax_finalize(exchange, nan_policy="propagate")[1]
        if not torch.equal(got, torch.argmax(gathered, dim=-1, keepdim=True)):
            return CheckResult(False, f"TP {tp}: the verify pick differs from torch.argmax")
    shard = logits[:, :width].contiguous()
    return _passed(
        device,
        f"TP 2/4/8 emulated, vocab {vocab}, {rows} rows with tie / NaN / -inf rows, both NaN "
        "rules: bit-identical",
        lambda: argmax.draft_argmax_finalize(
            argmax.draft_argmax_partials(shard, tp_rank=0, tp_size=8, vocab_size=vocab)
        ),
        lambda: postprocess(gathered, positions, None, 0),
        "times at TP 8: one rank's partials + finalize vs SGLang's pick on the gathered logits, "
        "communication not included",
    )


# --- the live-width indexer logits ------------------------------------------------------------------


def check_live_logits(device: torch.device) -> CheckResult:
    """More rows than the chunk size: our live-column copy of the chunks against SGLang's
    ``torch.cat`` of the same chunks (each chunk's logits from one seeded function, as SGLang's
    closure computes them), every live column bit for bit."""
    gen = torch.Generator().manual_seed(3)
    chunk_rows, width = (132, 8256) if device.type == "cuda" else (4, 2176)
    if device.type == "cuda":
        live.warm_up(device)
    rows = 2 * chunk_rows + 5
    lengths = torch.randint(0, width + 1, (rows, 1), dtype=torch.int32, generator=gen)
    lengths[:4, 0] = torch.tensor([0, 1, 64, width], dtype=torch.int32)
    lengths = lengths.to(device)
    source = torch.randn(rows, width, generator=gen).to(device)  # each row's logits, every column

    def logits_fn(q, *args, **kwargs):  # SGLang's closure's arguments; q carries the row indices
        return source[q[:, 0, 0, 0].long()].clone()

    q = torch.arange(rows, dtype=torch.float32, device=device).view(rows, 1, 1, 1)
    unused = torch.zeros(rows, 1, device=device)

    def ours():
        return live.chunked_paged_mqa_logits_live(
            logits_fn,
            lambda lens, block_kv, sms: None,
            q,
            None,
            unused,
            lengths,
            unused,
            width,
            chunk_rows=chunk_rows,
            block_kv=live.LIVE_BLOCK,
        )

    def sglang():
        chunks = range(0, rows, chunk_rows)
        return torch.cat([logits_fn(q[s : s + chunk_rows]) for s in chunks])

    got, want = ours(), sglang()
    live_cols = ((lengths[:, 0] + live.LIVE_BLOCK - 1) // live.LIVE_BLOCK) * live.LIVE_BLOCK
    columns = torch.arange(width, device=device)
    mask = columns[None, :] < live_cols.clamp(max=width)[:, None]
    if not torch.equal(got[mask], want[mask]):
        return CheckResult(False, "live columns differ from SGLang's concat")
    return _passed(
        device,
        f"{rows} rows in chunks of {chunk_rows}, width {width}: every live column identical",
        ours,
        sglang,
        "times: the chunks' logits function included",
    )


CHECKS: tuple[SelfCheck, ...] = (
    SelfCheck("bounded DSA replay metadata", check_bounded_replay_metadata, needs_cuda=True),
    SelfCheck("one-launch MTP draft decode metadata", check_draft_decode_metadata, needs_cuda=True),
    SelfCheck("draft argmax partials + finalize", check_draft_argmax_exchange),
    SelfCheck("live-width indexer logits (chunked)", check_live_logits),
)
