"""FlashMLA's tile-scheduler metadata op, as SGLang 0.5.23's DSA backend calls it, in a CUDA graph.

Under ``dsa_decode_impl == "flashmla_kv"`` SGLang's ``DeepseekSparseAttnBackend`` computes FlashMLA's
split-KV schedule on every replay (``_compute_flashmla_metadata`` in
``sglang/srt/layers/attention/dsa_backend.py``): ``get_mla_metadata`` of
``sglang/kernels/ops/attention/flash_mla_interface.py`` with ``num_q_tokens_per_head_k=seq_len_q *
num_heads_q``, ``num_heads_k=1``, ``is_fp8_kvcache=True`` and ``topk=index_topk``, which calls
``flash_mla.get_mla_decoding_metadata(..., use_legacy=True)`` (the ``sgl-flash-mla`` wheel). SGLang
passes ``seq_len_q=1`` always: a verify step has ``bs x num_draft_tokens`` rows of lengths.

The question: is that call safe to record in a CUDA graph (captured on a side stream, allocating in a
``torch.cuda.MemPool`` shared by all captures, as the plugin's metadata glue does) and to replay with
new lengths in the same input buffer? The test asks, for bs 1, 3, 16, 48, 64 and 128 query heads
(``flashmla_kv_num_q_heads``: GLM-5 and DeepSeek-V3.2 pad their local heads to one of them), and the
decode, verify (5 rows a request, as SGLang calls it) and ``seq_len_q=5`` shapes, at topk 2048:

- the capture works (no host synchronisation, no host read of a device value: either makes a
  ``thread_local`` capture raise), and eager calls make no synchronising torch call
  (``torch.cuda.set_sync_debug_mode("error")``);
- for 20 seeded length vectors (1 to 1M tokens, the edges 1, 64, 128, 2047, 2048, 2049 and 1M
  among them; never 0: SGLang's CUDA-graph fill value is 1), each written into the captured
  buffer, the outputs of a replay onto poisoned outputs are bit-identical to a fresh eager call
  on the same lengths, and no output's shape depends on the lengths;
- the shared pool holds the same bytes after a capture with lengths all 1 as with lengths all 1M.

Bit-identical: ``torch.equal`` on each output. The only exception is the ``_pad`` word of each
32-byte ``DecodingSchedMeta`` row (column 7 of the schedule, which FlashMLA's kernels never read):
a difference there alone is reported, not failed.

Negative controls, in the same test: outputs poisoned and not replayed differ from the eager ones;
the replay differs from an eager call at another topk (1024); and the same op without a topk (its
dense schedule, which does read the lengths on the device), captured and replayed the same way,
matches eager calls on the replayed lengths and differs from eager calls on other lengths. At
topk 2048 FlashMLA's scheduler takes every request's length as the topk, so the SGLang call's
outputs do not depend on the lengths at all: the table says so per case ("reads lengths").

FlashMLA comes from ``GPU_FLASH_MLA_DIR`` (a folder holding ``flash_mla/``, or a ``.tar.xz`` of one,
unpacked once into ``$TMPDIR``), else the installed package, else ``.whl/flash_mla-1.0.0.tar.xz``
(``bash test/pack_flash_mla.sh``). SGLang's ``flash_mla_interface.py`` is loaded by file path
(``support.reference``); where SGLang's files are not found, ``flash_mla.get_mla_decoding_metadata``
is called with the same arguments. Run it with ``-s`` to see the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from support import real_ops
from support.constants import POISON

BATCH_SIZES = (1, 3, 16, 48)
HEADS = (64, 128)
# (name, rows per request, seq_len_q): SGLang's decode; SGLang's verify of EAGLE 4/1/5 (5 draft
# tokens, each a row with seq_len_q 1); the same 5 tokens as seq_len_q 5 of one row.
Q_SHAPES = (("decode", 1, 1), ("verify-rows", 5, 1), ("seq_len_q-5", 1, 5))
TOPK = 2048
OTHER_TOPK = 1024
TRIALS = 20
MAX_LEN = 1 << 20
EDGE_LENGTHS = (1, 64, 128, 2047, 2048, 2049, MAX_LEN)
PAD_COLUMN = 7  # DecodingSchedMeta: 7 ints of schedule, then int _pad[1]


# ------------------------------------------------------------------------------------------------
# FlashMLA and SGLang's wrapper
# ------------------------------------------------------------------------------------------------


def import_flash_mla():
    """The real ``flash_mla`` with its legacy kernels (``support.real_ops``), or a skip that says
    what is missing."""
    try:
        flash_mla, where = real_ops.import_flash_mla()
    except real_ops.Unavailable as exc:
        print(exc)
        pytest.skip(f"needs FlashMLA: {exc}")
    print(f"flash_mla {flash_mla.__version__} from {Path(flash_mla.__file__).parent} ({where})")
    return flash_mla


def sglang_get_mla_metadata(flash_mla):
    """SGLang's ``get_mla_metadata`` (its own file, by path) and a label; where SGLang's files are
    not found, FlashMLA's op with the arguments SGLang's wrapper passes."""
    from support.reference import load_sglang_file

    try:
        module = load_sglang_file("kernels/ops/attention/flash_mla_interface.py")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"SGLang's flash_mla_interface.py not found ({e}): calling flash_mla directly")

        def direct(
            cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk
        ):
            return flash_mla.get_mla_decoding_metadata(
                cache_seqlens,
                num_q_tokens_per_head_k,
                num_heads_k,
                num_heads_q,
                is_fp8_kvcache,
                topk,
                use_legacy=True,
            )

        return direct, "flash_mla.get_mla_decoding_metadata(use_legacy=True)"
    assert module.flash_mla is flash_mla, "SGLang's wrapper imported another flash_mla"
    return module.get_mla_metadata, f"SGLang's get_mla_metadata ({module.__file__})"


# ------------------------------------------------------------------------------------------------
# Cases and comparisons
# ------------------------------------------------------------------------------------------------


def length_vectors(rows: int, seed: int) -> list[torch.Tensor]:
    """TRIALS int32 vectors of ``rows`` lengths in [1, 1M]: the edges in turn, all 1 (SGLang's
    fill value), all 1M, then each row an edge, log-uniform or uniform at random."""
    gen = torch.Generator().manual_seed(seed)
    edges = torch.tensor(EDGE_LENGTHS, dtype=torch.int64)
    vectors = [
        edges[torch.arange(rows) % len(EDGE_LENGTHS)],
        torch.ones(rows, dtype=torch.int64),
        torch.full((rows,), MAX_LEN, dtype=torch.int64),
    ]
    while len(vectors) < TRIALS:
        pick = torch.randint(0, 3, (rows,), generator=gen)
        edge = edges[torch.randint(0, len(EDGE_LENGTHS), (rows,), generator=gen)]
        log_uniform = torch.exp2(torch.rand(rows, generator=gen, dtype=torch.float64) * 20).long()
        uniform = torch.randint(1, MAX_LEN + 1, (rows,), generator=gen)
        vectors.append(torch.where(pick == 0, edge, torch.where(pick == 1, log_uniform, uniform)))
    return [v.clamp(1, MAX_LEN).to(torch.int32) for v in vectors]


def difference(actual, expected) -> tuple[str | None, bool]:
    """``(what differs, or None; whether it is only the _pad column of the schedule)``."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs against {len(expected)}", False
    pad_only = False
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape or a.dtype != e.dtype:
            return (
                f"output {i}: {tuple(a.shape)} {a.dtype} against {tuple(e.shape)} {e.dtype}",
                False,
            )
        if torch.equal(a, e):
            continue
        if i == 0 and a.dim() == 2 and a.shape[1] == PAD_COLUMN + 1:
            keep = torch.ones(a.shape[1], dtype=torch.bool, device=a.device)
            keep[PAD_COLUMN] = False
            if torch.equal(a[:, keep], e[:, keep]):
                pad_only = True
                continue
        where = (a != e).nonzero()[:4].tolist()
        shown = ", ".join(
            f"{tuple(ix)}: {a[tuple(ix)].item()} (poison: {a[tuple(ix)].item() == POISON}) "
            f"against {e[tuple(ix)].item()}"
            for ix in where
        )
        return f"output {i} differs in {int((a != e).sum())} elements, e.g. {shown}", False
    return None, pad_only


def pool_bytes(pool) -> tuple[int, int]:
    """(reserved, allocated) bytes of ``pool``: its segments, the blocks of them in use."""
    segments = pool.snapshot()
    return (
        sum(s["total_size"] for s in segments),
        sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"),
    )


def in_pool(pool, tensors) -> bool:
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
    return all(any(lo <= t.data_ptr() < hi for lo, hi in segments) for t in tensors)


def eager(call, lengths):
    """``call(lengths)`` with torch's synchronising calls made errors; outputs as a tuple."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return tuple(call(lengths))
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture(call, static, pool, stream):
    """Two eager warm-ups on the current stream, then ``call(static)`` captured on ``stream`` in
    ``pool`` (as SGLang's MetadataGlueGraph and the plugin's glue do); (graph, outputs)."""
    for _ in range(2):
        eager(call, static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        with torch.cuda.use_mem_pool(pool):
            outputs = tuple(call(static))
    torch.cuda.synchronize()
    return graph, outputs


@dataclass
class Case:
    op: str
    bs: int
    heads: int
    q: str
    rows: int
    seq_len_q: int
    topk: int | None
    pool_delta: int = 0
    pool_1_vs_1m: str = "-"
    shapes: str = "-"
    reads_lengths: str = "-"
    pad_only: int = 0
    pad_unwritten: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.failures:
            return "FAIL"
        if not self.pad_only:
            return "identical"
        return (
            f"identical (_pad differs in {self.pad_only}/{TRIALS}, "
            f"left unwritten by the replay in {self.pad_unwritten})"
        )


def run_case(case: Case, call, pool, stream, seed: int, controls: dict):
    """Fills ``case``; returns the graph captured in ``pool`` and its outputs (None if it failed)."""
    device = torch.device("cuda")
    lengths = [v.to(device) for v in length_vectors(case.rows, seed)]
    static = torch.ones(case.rows, dtype=torch.int32, device=device)

    # 1. The pool holds the same bytes whatever the lengths at capture (fresh pools, same call).
    held = []
    for fill in (1, MAX_LEN):
        own = torch.cuda.MemPool()
        static.fill_(fill)
        graph, outs = capture(call, static, own, stream)
        held.append(pool_bytes(own))
        del graph, outs
    case.pool_1_vs_1m = (
        f"{held[0][1]}={held[1][1]}" if held[0] == held[1] else f"{held[0]}!={held[1]}"
    )
    if held[0] != held[1]:
        case.failures.append(
            f"pool bytes (reserved, allocated) {held[0]} at lengths 1, {held[1]} at 1M"
        )

    # 2. The capture in the shared pool.
    before = pool_bytes(pool)[1]
    static.fill_(1)
    try:
        graph, outs = capture(call, static, pool, stream)
    except Exception as e:
        case.failures.append(f"capture raised {type(e).__name__}: {e}")
        return
    case.pool_delta = pool_bytes(pool)[1] - before
    if not in_pool(pool, outs):
        case.notes.append("outputs not in the shared pool")
    case.shapes = " ".join("x".join(map(str, o.shape)) for o in outs)

    # Negative control: outputs poisoned and not replayed must differ from eager ones.
    for o in outs:
        o.fill_(POISON)
    static.copy_(lengths[0])
    expected0 = eager(call, static)
    controls["poison"].append(difference(outs, expected0)[0] is not None)

    # 3. Replays onto poisoned outputs against fresh eager calls.
    eager_outputs = []
    for trial, lens in enumerate(lengths):
        static.copy_(lens)
        for o in outs:
            o.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        got = tuple(o.clone() for o in outs)
        try:
            want = eager(call, lens.clone())
        except Exception as e:
            case.failures.append(f"trial {trial}: eager call raised {type(e).__name__}: {e}")
            return
        eager_outputs.append(want)
        shapes = [tuple(o.shape) for o in want]
        if shapes != [tuple(o.shape) for o in outs]:
            case.failures.append(f"trial {trial}: eager shapes {shapes} differ from the graph's")
        diff, pad_only = difference(got, want)
        if diff is not None:
            case.failures.append(f"trial {trial} (lengths {lens[:6].tolist()}...): {diff}")
        case.pad_only += pad_only
        case.pad_unwritten += pad_only and bool((got[0][:, PAD_COLUMN] == POISON).all())
        # Negative control: against eager of the next trial's lengths (the dense control only
        # can differ there) and, for the SGLang call, against eager at another topk.
        other = lengths[(trial + 1) % len(lengths)].clone()
        if controls.get("lengths") is not None and case.topk is None:
            controls["lengths"].append(difference(got, eager(call, other))[0] is not None)
        if case.topk is not None and trial == 0:
            at_other_topk = controls["other_topk_call"](case, lens.clone())
            controls["topk"].append(difference(got, at_other_topk)[0] is not None)
    sensitive = any(difference(eager_outputs[0], w)[0] is not None for w in eager_outputs[1:])
    case.reads_lengths = "yes" if sensitive else "no"
    return graph, outs


def guarded(case: Case, *args):
    """``run_case``, with anything it raises recorded as the case's failure (the table still prints)."""
    try:
        return run_case(case, *args)
    except Exception as e:
        case.failures.append(f"raised {type(e).__name__}: {e}")
        return None


@pytest.mark.gpu
def test_flashmla_metadata_is_capture_safe_and_replays_bit_identical_to_eager():
    flash_mla = import_flash_mla()
    get_mla_metadata, label = sglang_get_mla_metadata(flash_mla)
    print(f"op under test: {label}")
    torch.cuda.synchronize()

    def sglang_call(heads, seq_len_q, topk):
        # dsa_backend.py's _compute_flashmla_metadata, with num_heads_q = flashmla_kv_num_q_heads
        return lambda lens: get_mla_metadata(
            cache_seqlens=lens,
            num_q_tokens_per_head_k=seq_len_q * heads // 1,
            num_heads_k=1,
            num_heads_q=heads,
            is_fp8_kvcache=True,
            topk=topk,
        )

    def dense_call(heads):
        # the same op without a topk: the dense schedule, which reads every length on the device
        return lambda lens: flash_mla.get_mla_decoding_metadata(
            lens, heads, 1, heads, False, None, use_legacy=True
        )

    controls = {
        "poison": [],
        "topk": [],
        "lengths": [],
        "other_topk_call": lambda case, lens: eager(
            sglang_call(case.heads, case.seq_len_q, OTHER_TOPK), lens
        ),
    }
    pool = torch.cuda.MemPool()
    stream = torch.cuda.Stream()
    cases, kept = [], []  # kept: every graph and its outputs, held until the pool is measured
    seed = 0
    for bs in BATCH_SIZES:
        for heads in HEADS:
            for q, per_request, seq_len_q in Q_SHAPES:
                case = Case("sglang fp8 topk", bs, heads, q, bs * per_request, seq_len_q, TOPK)
                kept.append(
                    guarded(case, sglang_call(heads, seq_len_q, TOPK), pool, stream, seed, controls)
                )
                cases.append(case)
                seed += 1
            case = Case("control: dense", bs, heads, "decode", bs, 1, None)
            kept.append(guarded(case, dense_call(heads), pool, stream, seed, controls))
            cases.append(case)
            seed += 1
    torch.cuda.synchronize()
    total = pool_bytes(pool)

    header = (
        f"{'op':<16} {'bs':>3} {'heads':>5} {'q':<12} {'rows':>4} {'outputs':<12} "
        f"{'kept B':>7} {'kept 1=1M':<16} {'reads lens':<10} verdict"
    )
    print(
        f"\nFlashMLA metadata in CUDA graphs on {torch.cuda.get_device_name()} "
        f"({torch.cuda.get_device_properties(0).multi_processor_count} SMs), torch "
        f"{torch.__version__}, flash_mla {flash_mla.__version__}, topk {TOPK}, {TRIALS} length "
        f"vectors a case"
    )
    print(header)
    print("-" * len(header))
    for c in cases:
        print(
            f"{c.op:<16} {c.bs:>3} {c.heads:>5} {c.q:<12} {c.rows:>4} {c.shapes:<12} "
            f"{c.pool_delta:>7} {c.pool_1_vs_1m:<16} {c.reads_lengths:<10} {c.verdict}"
            + (f"  [{'; '.join(c.notes)}]" if c.notes else "")
        )
    print(
        f"shared pool after all {len(cases)} captures, their {sum(k is not None for k in kept)} "
        f"graphs and outputs held: {total[0]} bytes reserved, {total[1]} allocated"
    )
    print(
        f"negative controls: poisoned outputs caught in {sum(controls['poison'])}/"
        f"{len(controls['poison'])} cases; topk {OTHER_TOPK} differs in {sum(controls['topk'])}/"
        f"{len(controls['topk'])}; dense replay against eager of other lengths differs in "
        f"{sum(controls['lengths'])}/{len(controls['lengths'])} trials"
    )

    failures = [f"{c.op} bs={c.bs} heads={c.heads} {c.q}: {f}" for c in cases for f in c.failures]
    assert not failures, "\n".join(failures[:20])
    assert all(controls["poison"]), "a replay that wrote nothing would not be caught"
    assert any(controls["topk"]), f"no case differs at topk {OTHER_TOPK}: the comparison is blind"
    assert any(controls["lengths"]), (
        "the dense control never differs against other lengths: the replays may not read the "
        "captured buffer"
    )
    dense = [c for c in cases if c.topk is None]
    assert all(c.reads_lengths == "yes" for c in dense), "the dense schedule ignored the lengths"
