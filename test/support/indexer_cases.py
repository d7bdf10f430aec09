"""Indexer paged-MQA logits scenarios: SGLang's chunked concat against the live-column copy.

Everything SGLang-side here is SGLang 0.5.23's own code, loaded from its files without importing the
``sglang`` package (:mod:`support.reference`), so it runs on a CUDA machine without
SGLang's dependencies too:

- :func:`sglang_split`: ``deepgemm_paged_mqa_logits_split`` (``kernels/ops/attention/dsa/paged_mqa_logits.py``);
- :func:`sglang_chunked_closure`: the ``_chunked_fp8_paged_mqa_logits`` closure of
  ``Indexer._get_topk_paged`` (``srt/layers/attention/dsa/dsa_indexer.py``), bound to a given SM
  count, block size, logits function and schedule function;
- :func:`torch_paged_mqa_logits`: SGLang's torch reference of DeepGEMM's paged-MQA logits
  (``fp8_paged_mqa_logits_torch``, used under ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``), reading
  ``[rows, 1]`` context lengths as SGLang's ``_fp8_paged_mqa_logits_torch`` does;
- :func:`sglang_topk`: what ``_get_topk_paged`` does after the logits: ``Indexer._mask_init_and_local_tokens``,
  then the torch top-k of ``DSATopKBackend`` (``_topk_unfused``).

:func:`paged_mqa_schedule` is SGLang's paged-MQA chunk schedule in torch (a function of every length,
unlike :func:`schedule_stand_in`, the timing stand-in); :class:`CallRecorder` records every logits and
schedule call with its arguments, and :func:`call_differences` compares two arms' calls.
:func:`stock_logits` and :func:`live_logits` compute the logits of a :class:`PagedMQACase` the way
SGLang does and the way the plugin's hook does (the same closure chunk by chunk, then
``chunked_paged_mqa_logits_live``); :func:`live_mismatches` compares their live columns bit for bit.
:class:`StandInCall` runs both at SGLang's 1M width with a stand-in for DeepGEMM (the benchmark).
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.kernels.ops.host import cdiv
from support.reference import load_sglang_file, sglang_function

HEAD_DIM = 128  # the indexer's head dim (DeepSeek-V3.2, GLM-5)
HEADS = 64  # DeepSeek-V3.2's index heads
BLOCK_KV = 64  # index-K page size: DeepGEMM's and the torch reference's block
INDEXER = "srt/layers/attention/dsa/dsa_indexer.py"
# Lengths every scenario cycles through: empty, one token, around a KV block, around 128 and 2048.
EDGE_LENGTHS = (0, 1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049)


@functools.cache
def sglang_split():
    """SGLang's ``deepgemm_paged_mqa_logits_split``: all rows as the batch of one logits call."""
    module = load_sglang_file("kernels/ops/attention/dsa/paged_mqa_logits.py")
    return module.deepgemm_paged_mqa_logits_split


def sglang_chunked_closure(sm_count: int, blocksize: int, logits_fn, schedule_fn):
    """SGLang's ``_chunked_fp8_paged_mqa_logits`` for an indexer with ``sm_count`` SMs, calling
    ``logits_fn`` and ``schedule_fn`` where SGLang calls DeepGEMM's (or their torch stand-ins)."""
    return sglang_function(
        INDEXER,
        "Indexer._get_topk_paged._chunked_fp8_paged_mqa_logits",
        {
            "torch": torch,
            "resolve_fp8_paged_mqa_logits_fn": lambda: logits_fn,
            "resolve_paged_mqa_logits_metadata_fn": lambda: schedule_fn,
        },
        closure={"self": SimpleNamespace(sm_count=sm_count), "blocksize": blocksize},
    )


@functools.cache
def _sglang_torch_logits():
    return sglang_function(
        "srt/layers/attention/dsv4/indexer.py",
        "fp8_paged_mqa_logits_torch",
        {
            "torch": torch,
            "F": torch.nn.functional,
            "FP8_DTYPE": torch.float8_e4m3fn,
            "_arange_cache": {},
        },
    )


def torch_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_table, schedule, max_len, clean_logits=False
):
    """SGLang's torch paged-MQA logits; ``[rows, 1]`` context lengths are read as ``[rows]``, as its
    ``_fp8_paged_mqa_logits_torch`` does (whose memory-budget row chunking is left out: it splits
    only batches too large for the GPU's memory)."""
    if context_lens.dim() == 2:
        context_lens = context_lens[:, 0]
    return _sglang_torch_logits()(
        q,
        kv_cache,
        weights,
        context_lens,
        block_table,
        schedule,
        max_len,
        clean_logits=clean_logits,
    )


def paged_mqa_schedule(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """DeepGEMM's paged-MQA chunk schedule as SGLang 0.5.23 computes it under
    ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH`` (``get_paged_mqa_logits_metadata``, a JIT kernel:
    ``kernels/jit/csrc/deepseek_v4/paged_mqa_metadata.cuh``), in torch: each row's context in
    256-token splits, the splits shared out over ``num_sms`` SMs (``total // num_sms`` each, the
    last ``total % num_sms`` one more), and for each of the ``num_sms + 1`` boundaries the ``(row,
    split)`` where it falls (``(rows, 0)`` past the last row): ``[num_sms + 1, 2]`` int32. Depends on
    every length and on ``num_sms``, so a logits call given another chunk's schedule is told apart;
    device operations only (it runs inside a CUDA-graph capture). ``block_kv`` is 64 or 128, as
    SGLang's kernel asserts; the schedule does not depend on it."""
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv must be 64 or 128, got {block_kv}")
    lens = context_lens.reshape(-1).to(torch.int64)
    rows, device = lens.shape[0], lens.device
    boundaries = torch.arange(num_sms + 1, device=device)
    if rows == 0:
        return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=device)
    prefix = torch.cumsum((lens + 255) // 256, 0)
    total = prefix[-1]
    target = boundaries * (total // num_sms) + (boundaries - (num_sms - total % num_sms)).clamp(
        min=0
    )
    row = torch.searchsorted(prefix, target, right=True)
    before = torch.where(row > 0, prefix[(row - 1).clamp(min=0)], 0)
    past = row >= rows
    schedule = torch.stack(
        [torch.where(past, rows, row), torch.where(past, 0, target - before)], dim=1
    )
    return schedule.to(torch.int32)


def schedule_stand_in(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """The timing stand-in for DeepGEMM's ``get_paged_mqa_logits_metadata`` (:class:`StandInCall`):
    a ``[num_sms + 1, 2]`` int32 buffer like its schedule, zeros, no work; the torch logits ignore
    it. Correctness checks use :func:`paged_mqa_schedule`."""
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


class CallRecorder:
    """A paged-MQA logits function and a schedule function that record each call's arguments
    (tensors copied as they are at the call) and run the functions they wrap:
    :meth:`logits_fn` and :meth:`schedule_fn` stand where SGLang resolves DeepGEMM's two;
    :meth:`take` returns the calls so far (``(kind, arguments)``, in order) and forgets them."""

    def __init__(self, logits_fn, schedule_fn=paged_mqa_schedule):
        self._logits, self._schedule = logits_fn, schedule_fn
        self.calls: list[tuple[str, tuple]] = []

    def logits_fn(
        self, q, kv_cache, weights, context_lens, block_table, schedule, max_len, clean_logits=False
    ):
        arguments = (
            q,
            kv_cache,
            weights,
            context_lens,
            block_table,
            schedule,
            max_len,
            clean_logits,
        )
        self.calls.append(("logits", tuple(map(_snapshot, arguments))))
        return self._logits(*arguments[:-1], clean_logits=clean_logits)

    def schedule_fn(self, context_lens, block_kv, num_sms):
        self.calls.append(("schedule", tuple(map(_snapshot, (context_lens, block_kv, num_sms)))))
        return self._schedule(context_lens, block_kv, num_sms)

    def take(self) -> list[tuple[str, tuple]]:
        calls, self.calls = self.calls, []
        return calls


LOGITS_ARGUMENTS = (
    "q",
    "kv_cache",
    "weights",
    "context_lens",
    "block_table",
    "schedule",
    "max_len",
    "clean_logits",
)
SCHEDULE_ARGUMENTS = ("context_lens", "block_kv", "num_sms")


def _snapshot(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def call_differences(ours, stock) -> list[str]:
    """Where two lists of :meth:`CallRecorder.take` calls differ: their count, and per call its
    kind and each argument (a tensor's dtype, shape and every byte; any other value by ``==``)."""
    if len(ours) != len(stock):
        return [f"{len(ours)} calls, SGLang's closure makes {len(stock)}"]
    found = []
    for index, ((kind, args), (stock_kind, stock_args)) in enumerate(zip(ours, stock)):
        if kind != stock_kind:
            found.append(f"call {index}: {kind}, SGLang's is {stock_kind}")
            continue
        names = LOGITS_ARGUMENTS if kind == "logits" else SCHEDULE_ARGUMENTS
        for name, value, expected in zip(names, args, stock_args):
            if not _same(value, expected):
                found.append(
                    f"call {index} ({kind}): {name} {_describe(value)}, SGLang's {_describe(expected)}"
                )
    return found


def _same(value, expected) -> bool:
    if not isinstance(expected, torch.Tensor) or not isinstance(value, torch.Tensor):
        return type(value) is type(expected) and value == expected
    if value.dtype != expected.dtype or value.shape != expected.shape:
        return False
    return torch.equal(_bytes(value), _bytes(expected))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return repr(value)


@functools.cache
def _sglang_mask():
    return sglang_function(INDEXER, "Indexer._mask_init_and_local_tokens", {"torch": torch})


@functools.cache
def _sglang_topk_unfused():
    return sglang_function(
        "srt/layers/attention/dsa/dsa_topk_backend.py", "_topk_unfused", {"torch": torch}
    )


def sglang_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    num_init_tokens: int = 0,
    num_local_tokens: int = 0,
) -> torch.Tensor:
    """What ``_get_topk_paged`` does with the logits: SGLang's init/local-token masking (in place),
    then SGLang's torch top-k transform (``--dsa-topk-backend torch``, unfused)."""
    indexer = SimpleNamespace(num_init_tokens=num_init_tokens, num_local_tokens=num_local_tokens)
    _sglang_mask()(indexer, logits, lengths)
    return _sglang_topk_unfused()(logits, lengths, topk)


@dataclasses.dataclass
class PagedMQACase:
    """The split function's inputs for one call, as ``_get_topk_paged`` passes them."""

    q: torch.Tensor  # [rows, heads, 128] fp8
    kv_cache: torch.Tensor  # [pages, 64, 1, 132] uint8: 64 fp8 keys then 64 fp32 scales a page
    weights: torch.Tensor  # [rows, heads] fp32
    context_lens: torch.Tensor  # [rows, 1] int32
    block_table: torch.Tensor  # [rows, max_len // 64] int32
    max_len: int

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        return self.context_lens[:, 0]

    def set_lengths(self, lengths) -> None:
        """New context lengths in place (a captured graph reads them on its next replay)."""
        self.context_lens.copy_(_lengths_tensor(lengths, self.context_lens.device))


def _lengths_tensor(lengths, device) -> torch.Tensor:
    return torch.as_tensor(list(lengths), dtype=torch.int32, device=device).view(-1, 1)


def make_paged_mqa_case(
    lengths,
    *,
    width: int,
    heads: int,
    device,
    generator: torch.Generator,
    pages: Optional[int] = None,
) -> PagedMQACase:
    """Random queries, keys (fp8 values from a normal draw, positive scales) and head weights;
    every row reads its own random permutation of ``pages`` KV pages (default: twice a row's)."""
    if width % BLOCK_KV:
        raise ValueError(f"width must be a multiple of {BLOCK_KV}, got {width}")
    lengths = list(lengths)
    rows, per_row = len(lengths), width // BLOCK_KV
    pages = 2 * per_row if pages is None else pages
    values = torch.randn(pages, BLOCK_KV * HEAD_DIM, generator=generator)
    scales = torch.rand(pages, BLOCK_KV, generator=generator) + 0.5
    kv = torch.cat(
        [values.to(torch.float8_e4m3fn).view(torch.uint8), scales.view(torch.uint8)], dim=1
    )
    block_table = torch.stack(
        [torch.randperm(pages, generator=generator)[:per_row] for _ in range(rows)]
    )
    q = torch.randn(rows, heads, HEAD_DIM, generator=generator).to(torch.float8_e4m3fn)
    return PagedMQACase(
        q=q.to(device),
        kv_cache=kv.view(pages, BLOCK_KV, 1, HEAD_DIM + 4).to(device),
        weights=torch.randn(rows, heads, generator=generator).to(device),
        context_lens=_lengths_tensor(lengths, device),
        block_table=block_table.to(torch.int32).to(device),
        max_len=width,
    )


def edge_lengths(rows: int, width: int) -> list[int]:
    """``rows`` lengths cycling through :data:`EDGE_LENGTHS` (those within the width) and the width."""
    pool = [n for n in EDGE_LENGTHS if n <= width] + [width]
    return [pool[i % len(pool)] for i in range(rows)]


def stock_logits(case: PagedMQACase, sm_count: int, logits_fn=torch_paged_mqa_logits):
    """SGLang 0.5.23's logits for ``case``: its split function with its chunked closure."""
    closure = sglang_chunked_closure(sm_count, BLOCK_KV, logits_fn, paged_mqa_schedule)
    return sglang_split()(
        closure,
        case.q,
        case.kv_cache,
        case.weights,
        case.context_lens,
        case.block_table,
        None,
        case.max_len,
        q_offset=case.rows,
    )


def live_logits(
    case: PagedMQACase, sm_count: int, logits_fn=torch_paged_mqa_logits, budget=None, out=None
):
    """The plugin's logits for ``case``: what its hook does with SGLang's closure when the rows
    exceed ``sm_count`` (the same closure per chunk, live columns copied into one output, ``out``
    when given)."""
    closure = sglang_chunked_closure(sm_count, BLOCK_KV, logits_fn, paged_mqa_schedule)
    return live.chunked_paged_mqa_logits_live(
        closure,
        paged_mqa_schedule,
        case.q.unsqueeze(1),
        case.kv_cache,
        case.weights,
        case.context_lens,
        case.block_table,
        case.max_len,
        chunk_rows=sm_count,
        block_kv=BLOCK_KV,
        budget=budget,
        out=out,
    )


def live_mismatches(ours: torch.Tensor, stock: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """Rows whose live columns (``[0, min(width, 64 * cdiv(length, 64)))``) differ in any bit."""
    width = stock.shape[1]
    ends = ((lengths.clamp(0, width) + BLOCK_KV - 1) // BLOCK_KV * BLOCK_KV).clamp(max=width)
    live_mask = torch.arange(width, device=stock.device)[None, :] < ends[:, None]
    differs = (ours.view(torch.int32) != stock.view(torch.int32)) & live_mask
    return differs.any(dim=1).nonzero().flatten().tolist()


def deepgemm_stand_in(live_columns: int):
    """In place of DeepGEMM's ``fp8_paged_mqa_logits`` (not on these machines): its output
    allocation (``[rows, align(width, 256)]`` fp32, viewed ``[:, :width]``) with the first
    ``live_columns`` columns written (``fill_``): the bytes DeepGEMM writes, none of its arithmetic.
    """

    def logits(q, kv_cache, weights, context_lens, block_table, schedule, max_len, clean_logits):
        aligned = cdiv(max_len, 256) * 256
        out = torch.empty((q.shape[0], aligned), dtype=torch.float32, device=q.device)
        out = out[:, :max_len]
        out[:, :live_columns].fill_(1.0)
        return out

    return logits


class StandInCall:
    """One indexer logits call of ``rows`` one-token queries at ``live`` tokens each, chunks of
    ``sm_count`` rows, logits from :func:`deepgemm_stand_in` (whole live 64-token blocks)."""

    def __init__(self, rows: int, live_len: int, width: int, sm_count: int, device):
        self.rows, self.width, self.sm_count = rows, width, sm_count
        self.logits_fn = deepgemm_stand_in(min(width, cdiv(live_len, BLOCK_KV) * BLOCK_KV))
        self.q = torch.zeros((rows, HEADS, HEAD_DIM), dtype=torch.float8_e4m3fn, device=device)
        self.kv = torch.zeros((1, BLOCK_KV, 1, HEAD_DIM + 4), dtype=torch.uint8, device=device)
        self.weights = torch.zeros((rows, HEADS), device=device)
        self.lens = torch.full((rows, 1), live_len, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((rows, width // BLOCK_KV), dtype=torch.int32, device=device)

    def chunks(self):
        """The logits calls alone, chunk by chunk, nothing joined: what both paths share."""
        for start in range(0, self.rows, self.sm_count):
            end = min(start + self.sm_count, self.rows)
            self.logits_fn(
                self.q[start:end].unsqueeze(1),
                self.kv,
                self.weights[start:end],
                self.lens[start:end],
                self.block_table[start:end],
                schedule_stand_in(self.lens, BLOCK_KV, self.sm_count),
                self.width,
                False,
            )

    def stock(self):
        """SGLang 0.5.23: its split function and chunked closure, the chunks joined by torch.cat."""
        closure = sglang_chunked_closure(self.sm_count, BLOCK_KV, self.logits_fn, schedule_stand_in)
        return sglang_split()(
            closure,
            self.q,
            self.kv,
            self.weights,
            self.lens,
            self.block_table,
            None,
            self.width,
            q_offset=self.rows,
        )

    def ours(self, budget=None):
        """The same chunks, live columns copied into one output."""
        return live.chunked_paged_mqa_logits_live(
            self.logits_fn,
            schedule_stand_in,
            self.q.unsqueeze(1),
            self.kv,
            self.weights,
            self.lens,
            self.block_table,
            self.width,
            chunk_rows=self.sm_count,
            block_kv=BLOCK_KV,
            budget=budget,
        )

    def mismatches(self) -> list[int]:
        """Rows whose live columns differ between ours and SGLang's concat."""
        return live_mismatches(self.ours(), self.stock(), self.lens[:, 0])
