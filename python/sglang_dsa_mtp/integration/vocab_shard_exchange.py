"""The vocab-shard argmax exchange: greedy EAGLE picks from per-shard argmax partials summed by
SGLang's own TP all-reduce, instead of from ``rows x vocab`` logits all-gathered over the TP ranks.

An engaged ``LogitsProcessor`` holds one :class:`VocabShardExchange`, built at its opt-in
(:func:`opt_in`) for one of two roles:

- :data:`DRAFT`, the draft model's processor: a draft-decode or graph draft-extend call reduces the
  rank's LM-head shard to argmax partials (``draft_argmax_partials``), all-reduces them and returns
  a stand-in for the logits (:meth:`~VocabShardExchange.stand_in`), from which the picks finalize;
- :data:`VERIFY`, the target model's processor: a target-verify call keeps the rank's shard and the
  picked tokens (``propagate`` rule) inside the storage of the call's fp32 logits buffer, the one
  SGLang shares between every captured graph (so a graph keeps no memory of its own), and returns
  the kept shard. A batch that needs SGLang's full logits gets them after the replay
  (:meth:`~VocabShardExchange.full_logits`): SGLang's own gather and cast of the kept rows.

The opt-in runs every check, once, and the TP ranks agree on its answer: SGLang's LM-head path is a
plain bf16/fp32 matmul over the rank's contiguous vocab shard, the shard fits the partials' layout,
SGLang's all-reduce of the exchange buffer would not run on NCCL inside a CUDA-graph capture
(:func:`all_reduce_route`), every kernel variant compiles, and the processor's logits tail then runs
once per row-count class on every rank in lockstep (its gather builds its buffers on its first eager
call). The per-call path checks nothing but the verify call's buffer, and never falls back to
SGLang's gather: a rank that did so alone would meet its peers' all-reduce with a gather.

Hooks here (the EAGLE worker's are ``eagle_argmax``'s):

- AROUND ``LogitsProcessor._get_logits`` (:func:`exchange_logits`), the one hook of both roles: a
  target-verify call of an engaged target keeps its shard; a greedy-draft call of an engaged draft
  exchanges; every other call is SGLang's;
- AFTER ``LogitsProcessor.forward`` (:func:`attach_partials`): an exchanged draft call's output names
  the exchange buffer in ``next_token_argmax_partials``;
- ``LogitsProcessor.enable_draft_argmax_exchange`` (added to the class): the draft opt-in.

The hand-off (:data:`HANDOFF`, a :class:`HandOff`). SGLang hands ``draft_topk1_postprocess`` and
``eagle_sample`` tensors, never the processor that made them, and no object of its own crosses from
``eagle_sample`` to ``verify_tree_greedy_func`` or from ``_draft_extend_for_decode`` to the replay
inside it. So the one hand-off holds each role's engaged exchange (set by the opt-in; one target
and one draft model per SGLang process) and the two values a round passes from an outer hook to the
inner one, each set and cleared in ``try``/``finally`` by the outer hook. Everything else is
recognised from the tensor by the exchange that made it: a stand-in by its layout, an fp32
``[rows, vocab]`` view of stride ``(row_width, 0)`` (no logits are ever laid out so: SGLang's own
``draft_topk1_postprocess`` refuses it), so a row slice of one leads to the same exchange rows; a
kept shard by the one buffer storage the verify exchange keeps into (its :class:`Placement`).

Caveats: what "bit for bit" rests on.

- NaN: two rules, one set of partials. The draft decode picks as ``draft_topk1_postprocess``
  (``sanitize``: NaN counts as -1e30, the lowest column among the maxima, 0 for an all-NaN row);
  the draft extend and the verify pick as ``torch.argmax`` (``propagate``: the first NaN wins).
  Every split records the max with NaN as -1e30 and, apart, its first NaN column.
- -0.0: merged into +0.0 before a max becomes a key, so the two tie and the lower column wins, as
  under both rules. The buffer carries integer keys and columns, never a logit: no lane holds -0.0
  or a NaN, so an all-reduce that canonicalises NaN, turns -0.0 into +0.0 or uses -0.0 as its
  "not yet written" sentinel (Lamport) sums it exactly.
- Subnormals: a max's key is its fp32 bit pattern compared as an integer, so nothing is flushed to
  zero: a subnormal beats +0.0 and subnormals keep their order, as in the gathered fp32 logits.
  Triton's interpreter converts bf16 subnormals to fp32 wrongly, so only a GPU vouches for those.
- The shared logits buffer's writers. The kept shard and its tokens live in SGLang's fp32 logits
  buffer, the process-wide ``GraphSharedOutput.get_logits_buffer(vocab)``, which two graphs write
  every round: the target-verify graph that replays (the kept shard from the storage's start, the
  tokens after every row's shard), and the draft-extend graph (``EAGLEDraftExtendCudaGraphRunner``
  takes the same buffer for the same vocab), whose LM head (TP 1) or cast writes its fp32 logits
  into rows ``[0, bs)`` wherever the draft exchange does not replace them (TP 1, the draft switch
  off): over the kept shard. Harmless only because of the order of SGLang's round
  (``EAGLEWorkerV2.forward_batch_generation``): the target-verify replay and every read of its
  output (``eagle_sample``, then ``compute_spec_logprobs``, both inside ``run_eagle_verify``) are
  enqueued on the stream before ``_draft_extend_for_decode`` replays the draft extend, and the next
  round's target-verify replay writes shard and tokens again before anything reads them. The full
  logits of a non-greedy batch are cast over the rows they come from (the gather reads them first;
  at TP 1 they are copied out first), where the draft extend then overwrites them as it overwrites
  SGLang's own.

Details: docs/switches.md, "Greedy-draft argmax exchange" and "Greedy target-verify argmax exchange".
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from sglang.srt.layers import logits_processor as sglang_logits
from sglang.srt.layers.logits_processor import LogitsMetadata
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from torch.multiprocessing.reductions import StorageWeakRef

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.integration.state import ProcessorState, peek, state_of
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
    LOGITS_DTYPES,
    MAX_VOCAB,
    exchange_shape,
    launch_finalize,
    launch_partials,
    partials_layout,
    warm_up,
)
from sglang_dsa_mtp.log import log_failure, log_once
from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE, VERIFY_ARGMAX_EXCHANGE, KillSwitch

TOKEN_DTYPE = torch.int64  # the picked tokens, as SGLang's argmax gives them
BUFFER_DTYPE = torch.float32  # SGLang's logits buffer
NO_PARTIALS = None  # LogitsProcessorOutput.next_token_argmax_partials everywhere else
DEFAULT_MAX_ROWS = 256
# The verify's full-logits tail (SGLang's gather and cast of the kept rows) runs ahead at one row
# count of each class Triton specializes an integer argument on: 1, a multiple of 16, any other.
FULL_LOGITS_WARM_UP_ROWS = (1, 3, 16)


@dataclass(frozen=True)
class Role:
    """One of the exchange's two call sites; ``name`` is its field of the processor's
    ``ProcessorState`` and of :class:`HandOff`, the rest words its log line."""

    name: str
    switch: KillSwitch
    on: str
    off: str
    softcapping: str  # why final-logit softcapping keeps SGLang's path


DRAFT = Role(
    "draft",
    DRAFT_ARGMAX_EXCHANGE,
    on="greedy draft exchanges argmax partials",
    off="greedy draft keeps the logits gather",
    softcapping="final-logit softcapping gathers fp32 logits and caps them (fused gather kept)",
)
VERIFY = Role(
    "verify",
    VERIFY_ARGMAX_EXCHANGE,
    on="greedy target verify takes its argmax from exchanged argmax partials",
    off="target verify keeps SGLang's full logits",
    softcapping="final-logit softcapping: SGLang gathers fp32 logits and caps them in a fused kernel",
)


# --- which all-reduce SGLang would run inside a graph capture -------------------------------------
# SGLang 0.5.23's GroupCoordinator.all_reduce picks per call (srt/distributed/parallel_state.py):
# CPU tensors go to shared memory or torch.distributed; with --enable-symm-mem and neither MSCCL++
# nor the custom all-reduce eligible, pynccl; FlashInfer's all-reduce when the group has its
# workspace and the tensor fits; then the out-of-place method its _resolve_outplace_all_reduce_method
# picks; else in place, which inside graph_capture() is pynccl (enabled there), else
# torch.distributed (NCCL). all_reduce_route follows that without side effects, asking SGLang's own
# method on a view of the group where the custom all-reduce answers as inside its capture() (the
# V2's answer depends on it; entering capture() would register graph buffers on exit). Every input
# is group-wide configuration; agree_across_group makes the answer the same on every rank regardless.

# The out-of-place methods, as routes (the custom all-reduce's named with its class), and whether
# each runs on NCCL.
_OUT_OF_PLACE = {
    "ca": ("custom all-reduce ({ca})", False),
    "pcie_ipc": ("PCIe IPC all-reduce", False),
    "qr": ("quick all-reduce", False),
    "pymscclpp": ("MSCCL++", False),
    "torch_symm_mem": ("torch symmetric memory", False),
    "pynccl": ("pynccl out of place", True),
}


def _custom_all_reduce_in_capture(ca, probe: torch.Tensor) -> bool:
    if ca is None or ca.disabled:
        return False
    nbytes = probe.numel() * probe.element_size()
    takes = sglang_surface.custom_all_reduce_v2_takes(ca, nbytes)
    if takes is None:  # the legacy CustomAllreduce: the same answer in capture
        return bool(ca.should_custom_ar(probe))
    if nbytes % 16 != 0 or not probe.is_contiguous():
        return False
    if ca.override_algo is not None:
        return nbytes <= ca.max_size
    return takes


def all_reduce_route(group, probe: torch.Tensor) -> tuple[str, bool]:
    """``(route, on_nccl)``: what ``group.all_reduce(probe)`` would run inside a CUDA-graph capture."""
    if group.world_size == 1:
        return "none (one rank)", False
    if probe.is_cpu:
        return "CPU shared memory or torch.distributed", False
    if not probe.is_cuda:
        return f"{probe.device.type} communicator (not evaluated)", True
    mscclpp = group.pymscclpp_comm is not None and bool(
        group.pymscclpp_comm.should_mscclpp_allreduce(probe)
    )
    custom = _custom_all_reduce_in_capture(group.ca_comm, probe)
    if (
        group.pynccl_comm is not None
        and group.is_symmetric_memory_enabled()
        and not mscclpp
        and not custom
    ):
        return "pynccl with symmetric memory (--enable-symm-mem)", True
    if sglang_surface.flashinfer_all_reduce_takes(group, probe):
        return "FlashInfer all-reduce", False
    ca = group.ca_comm
    in_capture = SimpleNamespace(  # the communicators SGLang's method reads, as inside a capture
        ca_comm=(
            None
            if ca is None
            else SimpleNamespace(disabled=ca.disabled, should_custom_ar=lambda _: custom)
        ),
        pcie_ipc_comm=group.pcie_ipc_comm,
        qr_comm=group.qr_comm,
        pymscclpp_comm=group.pymscclpp_comm,
        torch_symm_mem_comm=group.torch_symm_mem_comm,
        pynccl_comm=group.pynccl_comm,
    )
    method = sglang_surface.outplace_all_reduce_method(
        in_capture, probe, should_use_pymscclpp_allreduce=mscclpp
    )
    if method is not None:
        route, nccl = _OUT_OF_PLACE[method]
        return route.format(ca=type(ca).__name__), nccl
    if group.pynccl_comm is not None:
        return "pynccl (in place)", True
    return "torch.distributed (NCCL)", True


def agree_across_group(group, reason: Optional[str]) -> Optional[str]:
    """``reason`` on every rank if any rank has one (None only when all ranks have none).

    A collective on the group's CPU (gloo) group: every rank must call it. Should the collective
    itself fail, this rank keeps SGLang's path, saying why."""
    cpu_group = getattr(group, "cpu_group", None)
    if group.world_size == 1 or cpu_group is None:
        return reason
    blocked = torch.tensor([0 if reason is None else 1], dtype=torch.int32)
    try:
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX, group=cpu_group)
    except Exception as exc:
        return reason or f"the TP ranks could not agree ({type(exc).__name__}: {exc})"
    if reason is None and int(blocked.item()):
        return "another TP rank keeps the gather (its reason is in its log)"
    return reason


# --- the checks -----------------------------------------------------------------------------------


def lm_head_quant(lm_head) -> tuple[str, bool]:
    """(the head's quant method class, whether SGLang's LM-head path applies it).

    The answer is SGLang's own ``should_apply_lm_head_quant_method``, which its
    ``LogitsProcessor._compute_lm_head`` asks at every call (the module defines it twice; the later
    definition is the one the module name holds, and the one asked here). A NextN draft head built
    with a ModelOpt quant config keeps its ``ModelOptFp4LinearMethod`` after SGLang swaps in the
    target's bf16 weight: the method is then not applied, and the head is a plain matmul."""
    method = getattr(lm_head, "quant_method", None)
    name = type(method).__name__ if method is not None else "none"
    return name, bool(sglang_logits.should_apply_lm_head_quant_method(lm_head, method))


def lm_head_blocker(lm_head, group) -> Optional[str]:
    """Why SGLang's LM-head path for ``lm_head`` is not a plain bf16/fp32 matmul over this rank's
    contiguous vocab shard (the only layout the partials read), or None."""
    if hasattr(lm_head, "set_lora"):
        return "the LM head is LoRA-wrapped"
    if not isinstance(lm_head, ParallelLMHead):
        return f"the LM head is a {type(lm_head).__name__}, not a vocab-parallel ParallelLMHead"
    if not lm_head.enable_tp or lm_head.use_attn_tp_group:
        return "the LM head is not sharded over the TP group"
    quant_method, applied = lm_head_quant(lm_head)
    if applied:
        return (
            f"SGLang applies the LM head's quant method {quant_method} (a quantized LM-head kernel)"
        )
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return f"the LM head has no plain weight (SGLang runs its quant method {quant_method})"
    if getattr(lm_head, "bias", None) is not None:
        return "the LM head has a bias"
    if lm_head.num_added_embeddings:
        return f"the LM head has {lm_head.num_added_embeddings} added (LoRA) vocab entries"
    if weight.dtype not in LOGITS_DTYPES:
        return f"the LM head weight is {weight.dtype}, the partials take bf16 or fp32"
    if lm_head.tp_size != group.world_size:
        return f"the LM head has {lm_head.tp_size} shards, the TP group {group.world_size} ranks"
    width = lm_head.num_embeddings_per_partition
    start = lm_head.shard_indices.padded_org_vocab_start_index
    if start != group.rank_in_group * width or weight.shape[0] != width:
        return "the LM head's shard is not the rank's contiguous slice of the vocab"
    return None


def logits_dtypes(processor, lm_head) -> tuple[torch.dtype, ...]:
    """The dtypes SGLang's ``_compute_lm_head`` can give this head's shard logits: fp32 with
    ``--enable-fp32-lm-head``; else the weight's, plus fp32 with an fp32 LM-head output, plus bf16
    under an RL on-policy target (it casts the matmul to bf16)."""
    if processor.use_fp32_lm_head:
        return (torch.float32,)
    dtypes = [lm_head.weight.dtype]
    if processor.use_fp32_lm_head_output:
        dtypes.append(torch.float32)
    if getattr(processor, "rl_on_policy_target", None) is not None:
        dtypes.append(torch.bfloat16)
    return tuple(dict.fromkeys(dtypes))


def head_facts(lm_head) -> dict:
    """The LM head's facts for the log line, as far as they can be read."""
    facts = {}
    try:
        quant_method, applied = lm_head_quant(lm_head)
        facts["LM-head quant method"] = (
            f"{quant_method} ({'applied' if applied else 'not applied'} by SGLang)"
        )
    except Exception as exc:
        facts["LM-head quant method"] = f"unknown ({type(exc).__name__})"
    weight = getattr(lm_head, "weight", None)
    facts["head dtype"] = (
        str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else "none"
    )
    return facts


def _processor_blocker(processor, role: Role, tp_size: int) -> Optional[str]:
    """Why the processor's own logits path keeps SGLang's, for ``role``, or None."""
    gathers = processor.do_tensor_parallel_all_gather
    if role is DRAFT and not gathers:
        return "the processor does not gather logits across TP ranks (tp size 1 or skip_all_gather)"
    if processor.use_attn_tp_group:
        return "DP LM head (--enable-dp-lm-head) gathers over the attention-TP group"
    if processor.do_tensor_parallel_all_gather_dp_attn:
        return "DP attention gathers hidden states across DP ranks"
    if processor.use_tp_lm_head_all_to_all:
        return "the TP LM-head all-to-all (--enable-tp-lm-head-all-to-all) owns the layout"
    if role is VERIFY and tp_size > 1 and not gathers:
        return "the processor does not gather its vocab shards (skip_all_gather)"
    if processor.final_logit_softcapping:
        return role.softcapping
    fp32 = processor.use_fp32_lm_head or processor.use_fp32_lm_head_output
    if role is VERIFY and tp_size == 1 and fp32:
        return "at TP 1 SGLang's fp32 LM head writes its logits into the fp32 buffer itself"
    if not 1 <= processor.vocab_size <= MAX_VOCAB:
        return f"vocab size {processor.vocab_size} is outside 1..{MAX_VOCAB}"
    return None


def kept_bytes_per_row(width: int, dtype: torch.dtype) -> int:
    """The bytes one kept row takes: its shard row and its picked token."""
    return width * dtype.itemsize + TOKEN_DTYPE.itemsize


def _kept_fit_blocker(processor, lm_head) -> Optional[str]:
    """Why a kept shard row and its token would not fit one row of SGLang's fp32 logits buffer for
    some logits dtype of this head (an fp32 shard at TP 1), or None."""
    width, buffer_row = lm_head.num_embeddings_per_partition, processor.vocab_size * 4
    for dtype in logits_dtypes(processor, lm_head):
        if kept_bytes_per_row(width, dtype) > buffer_row:
            return (
                f"a {str(dtype).removeprefix('torch.')} shard row of {width} columns and its token "
                f"do not fit a {processor.vocab_size}-column fp32 row of SGLang's logits buffer"
            )
    return None


def _shard_blocker(processor, lm_head, group, rows, facts, draft_steps) -> Optional[str]:
    """The checks of the shard itself: the logits dtypes, the layout, the all-reduce route of the
    exchange buffer at 1 and the most ``rows`` (never NCCL inside a CUDA-graph capture), and every
    kernel variant for ``rows`` compiled ahead; ``facts`` gets the route and the variant count."""
    shard_width = lm_head.num_embeddings_per_partition
    dtypes = logits_dtypes(processor, lm_head)
    if any(dtype not in LOGITS_DTYPES for dtype in dtypes):
        return f"SGLang's LM head can give {dtypes} logits; the partials take bf16 or fp32"
    try:
        partials_layout(
            shard_width=shard_width,
            tp_rank=group.rank_in_group,
            tp_size=group.world_size,
            vocab_size=processor.vocab_size,
        )
    except (TypeError, ValueError) as exc:
        return f"the LM head's shard does not fit the exchange ({exc})"
    for probe_rows in sorted({1, max(rows)}):
        probe = torch.empty(
            exchange_shape(probe_rows, shard_width, group.world_size),
            dtype=torch.float32,
            device=lm_head.weight.device,
        )
        route, nccl = all_reduce_route(group, probe)
        facts["all-reduce"] = route
        if nccl:
            return (
                f"the exchange's all-reduce ({probe_rows} rows) would run on NCCL ({route}) "
                "inside the CUDA-graph capture"
            )
    try:
        variants = warm_up(
            rows=rows,
            shard_width=shard_width,
            tp_size=group.world_size,
            vocab_size=processor.vocab_size,
            dtypes=dtypes,
            device=lm_head.weight.device,
            draft_steps=draft_steps,
        )
    except Exception as exc:
        return f"compiling the exchange kernels ahead failed ({type(exc).__name__}: {exc})"
    facts["kernel variants compiled ahead"] = len(variants)
    return None


def _local_blocker(processor, lm_head, role, group, rows, draft_steps, facts) -> Optional[str]:
    """Why this rank must keep SGLang's path for ``role``, or None, before the ranks agree."""
    if role is VERIFY:
        facts["verify rows up to"] = max(rows)
    enabled, why = role.switch.state()
    reason = (
        (None if enabled else why)
        or _processor_blocker(processor, role, group.world_size)
        or lm_head_blocker(lm_head, group)
        or (_kept_fit_blocker(processor, lm_head) if role is VERIFY else None)
    )
    return reason or _shard_blocker(processor, lm_head, group, rows, facts, draft_steps)


# --- the exchange ---------------------------------------------------------------------------------


class Placement(NamedTuple):
    """Where the verify keeps into one logits buffer storage: the shard's ``[rows, width]`` rows in
    ``dtype`` from the storage's start, then the int64 tokens of all ``capacity`` rows (the
    storage's fp32 rows of vocab columns), so that every row count finds its rows at the same
    place. ``storage`` pins the storage's identity: a new one at a freed one's address is another.
    """

    storage: StorageWeakRef
    width: int
    dtype: torch.dtype
    capacity: int

    def tokens_offset(self) -> int:
        """The tokens' first element (int64) in the storage."""
        return -(-self.capacity * self.width * self.dtype.itemsize // TOKEN_DTYPE.itemsize)


class KeptRows(NamedTuple):
    """Rows of a kept shard found again: ``start``, the first one's row in the buffer, and
    ``tokens``, their picked tokens (int64 ``[rows, 1]``)."""

    start: int
    tokens: torch.Tensor


def _view(storage, dtype: torch.dtype, offset: int, shape) -> torch.Tensor:
    """A contiguous ``shape`` view of ``storage`` as ``dtype``, from element ``offset``."""
    tensor = torch.empty(0, dtype=dtype, device=storage.device)
    return tensor.set_(storage, offset, shape, (shape[1], 1))


class VocabShardExchange:
    """One engaged processor's exchange in one ``role``: ``lm_head``, the head its calls must pass;
    ``layout``, the rank's checked share of the exchange; ``route``, the all-reduce named at the
    opt-in; ``row_width``, the exchange buffer's fp32 columns; ``placement``, where the verify
    keeps (None before its first call)."""

    def __init__(self, role: Role, processor, lm_head, group, route: Optional[str]):
        self.role, self.processor, self.lm_head, self.route = role, processor, lm_head, route
        width = lm_head.num_embeddings_per_partition
        self.layout = partials_layout(
            shard_width=width,
            tp_rank=group.rank_in_group,
            tp_size=group.world_size,
            vocab_size=processor.vocab_size,
        )
        self.row_width = exchange_shape(1, width, group.world_size)[1]
        self.placement: Optional[Placement] = None

    def takes(self, lm_head, metadata, embedding_bias) -> bool:
        """Whether a ``_get_logits`` call is this exchange's: its head, no embedding bias, no
        logprobs; a target verify (VERIFY), or a draft decode or graph draft extend (DRAFT)."""
        if lm_head is not self.lm_head or embedding_bias is not None:
            return False
        if metadata.extend_return_logprob:  # logprobs read the logits
            return False
        mode = metadata.forward_mode
        if self.role is VERIFY:
            return mode.is_target_verify()
        if mode.is_decode():
            return True
        return mode.is_draft_extend_v2() and metadata.draft_extend_select_index is not None

    def _partials(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard``'s argmax partials summed over the TP group by SGLang's all-reduce."""
        exchange = launch_partials(self.layout, shard)
        if self.layout.tp_size > 1:
            exchange = get_parallel().tp_group.all_reduce(exchange)
        return exchange

    def _shard(self, hidden_states) -> torch.Tensor:
        """This rank's LM-head shard logits as SGLang's ``_get_logits`` computes them."""
        logits = sglang_surface.compute_lm_head(self.processor, hidden_states, self.lm_head)
        if self.processor.logit_scale is not None:
            logits.mul_(self.processor.logit_scale)
        return logits

    # --- the draft --------------------------------------------------------------------------------

    def exchange(self, hidden_states) -> torch.Tensor:
        """The draft call: the all-reduced exchange buffer of the rows, behind a stand-in."""
        return self.stand_in(self._partials(self._shard(hidden_states)).contiguous())

    def stand_in(self, exchange: torch.Tensor) -> torch.Tensor:
        """A zero-stride ``[rows, vocab]`` view of the contiguous ``exchange`` (no logits, no
        memory): the shape SGLang's draft worker reads (its bounds probe), the buffer behind it."""
        return exchange[:, :1].expand(exchange.shape[0], self.processor.vocab_size)

    def exchange_rows(self, logits) -> Optional[torch.Tensor]:
        """The exchange buffer rows behind a :meth:`stand_in` (or a row slice of one), else None:
        real logits, another exchange's stand-in, None, anything else."""
        width = self.row_width
        if (
            not isinstance(logits, torch.Tensor)
            or logits.dim() != 2
            or logits.dtype != torch.float32
            or logits.shape[1] != self.processor.vocab_size
            or logits.stride() != (width, 0)
        ):
            return None
        return logits.as_strided((logits.shape[0], width), (width, 1))

    # --- the target verify ------------------------------------------------------------------------

    def buffer_blocker(self, buffer, rows: int) -> Optional[str]:
        """Why ``buffer`` (the call's ``next_token_logits_buffer``) cannot hold this call's kept
        shard and tokens, or None: it must be SGLang's fp32 ``[rows, vocab]`` buffer, on the
        shard's device, starting a storage of whole fp32 rows."""
        vocab = self.processor.vocab_size
        if buffer is None:
            return (
                "the call has no logits buffer (an eager target verify, or use_logits_buffer off)"
            )
        if buffer.dtype != BUFFER_DTYPE or buffer.device != self.lm_head.weight.device:
            return f"the logits buffer is {buffer.dtype} on {buffer.device}"
        if tuple(buffer.shape) != (rows, vocab) or not buffer.is_contiguous():
            return (
                f"the logits buffer is {tuple(buffer.shape)}, not the call's contiguous {rows} rows"
            )
        if buffer.storage_offset() != 0 or buffer.untyped_storage().nbytes() % (vocab * 4):
            return "the logits buffer does not start a storage of whole fp32 rows"
        return None

    def keep(self, hidden_states, buffer: torch.Tensor) -> torch.Tensor:
        """The target-verify call (``buffer`` checked by :meth:`buffer_blocker`): this rank's shard
        kept in ``buffer``'s storage, its argmax partials all-reduced and the ``propagate``
        finalize's tokens kept beside it; returns the kept shard.

        The shard is SGLang's own output copied, not a matmul into the buffer: bit for bit SGLang's
        whichever LM-head branch it takes. The copy is no larger than the transient SGLang's own
        call allocates for the same output before its gather and cast, and it is freed before the
        partials are allocated, so the call's peak stays at most SGLang's."""
        shard = self._shard(hidden_states)
        kept, tokens = self.keep_in_buffer(shard, buffer)
        del shard
        tokens.copy_(launch_finalize(self._partials(kept), propagate_nan=True)[1])
        return kept

    def keep_in_buffer(self, shard: torch.Tensor, buffer: torch.Tensor):
        """Copy ``shard`` into the storage of ``buffer`` (its :attr:`placement`, moved there when it
        is another storage); returns ``(kept, tokens)``: the kept ``[rows, width]`` shard and the
        int64 ``[rows, 1]`` view of the storage where the rows' tokens go."""
        storage = buffer.untyped_storage()
        rows, width = shard.shape
        key = StorageWeakRef(storage)
        place = self.placement
        if place is None or place.storage != key or place.dtype != shard.dtype:
            capacity = storage.nbytes() // (self.processor.vocab_size * 4)
            place = Placement(key, width, shard.dtype, capacity)
            if (place.tokens_offset() + capacity) * TOKEN_DTYPE.itemsize > storage.nbytes():
                # The opt-in's _kept_fit_blocker rules this out.
                raise ValueError(f"{capacity} kept rows of {width} columns do not fit the buffer")
            self.placement = place
        kept = _view(storage, shard.dtype, 0, (rows, width))
        kept.copy_(shard)
        return kept, _view(storage, TOKEN_DTYPE, place.tokens_offset(), (rows, 1))

    def kept_rows(self, logits) -> Optional[KeptRows]:
        """:class:`KeptRows` when ``logits`` is this exchange's kept shard or a row slice of one (as
        SGLang's graph runner hands it on: ``[: raw rows]``), else None (real logits, SGLang's own
        in the same buffer included, None, anything else)."""
        place = self.placement
        if place is None or not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return None
        if (
            logits.is_meta
            or logits.dtype != place.dtype
            or logits.shape[1] != place.width
            or logits.stride() != (place.width, 1)
            or logits.storage_offset() % place.width
            or StorageWeakRef(logits.untyped_storage()) != place.storage
        ):
            return None
        start, rows = logits.storage_offset() // place.width, logits.shape[0]
        offset = place.tokens_offset() + start
        return KeptRows(start, _view(logits.untyped_storage(), TOKEN_DTYPE, offset, (rows, 1)))

    def full_logits(self, shard_rows: torch.Tensor, start: int) -> torch.Tensor:
        """SGLang's verify logits of the kept ``shard_rows`` (from buffer row ``start``): the
        processor's own logits all-gather of them (at TP > 1) and its ``_copy_logits_to_buffer``
        into those rows of the fp32 logits buffer the shard lives in, as SGLang's ``_get_logits``
        ends a call without softcapping. At TP 1 the rows are copied out first: the cast writes
        over the shard it reads (a copy no larger than the transient SGLang's own call allocates).
        """
        vocab, rows = self.processor.vocab_size, shard_rows.shape[0]
        buffer = _view(shard_rows.untyped_storage(), BUFFER_DTYPE, start * vocab, (rows, vocab))
        if not self.processor.do_tensor_parallel_all_gather:
            shard_rows = shard_rows.clone()
        return _gather_and_cast(self.processor, shard_rows, buffer)


def _gather_and_cast(processor, shard_rows: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The tail of SGLang's ``_get_logits`` in target verify: the processor's logits gather (at
    TP > 1), then its ``_copy_logits_to_buffer`` into ``buffer``."""
    logits = shard_rows
    if processor.do_tensor_parallel_all_gather:
        logits = sglang_surface.gather_logits(processor, shard_rows)
    metadata = LogitsMetadata(
        forward_mode=ForwardMode.TARGET_VERIFY, next_token_logits_buffer=buffer
    )
    return sglang_surface.copy_logits_to_buffer(processor, logits, metadata)


def _warm_up_tail(exchange: VocabShardExchange) -> None:
    """Run the engaged processor's logits tail on zero shards, on every rank in lockstep, so that
    what it builds lazily exists before the first request. The draft's: its gather, once (SGLang's
    multimem all-gather builds its symmetric-memory buffer on its first eager call: without the
    exchange a draft-decode capture warm-up, with it the first draft prefill while serving). The
    verify's: its gather and cast at each of :data:`FULL_LOGITS_WARM_UP_ROWS` and logits dtype
    (SGLang's gather and cast kernels compile per row-count class).

    Each step allocates this rank's inputs (which may fail on one rank alone), then runs the
    collective. The ranks agree before each collective that every rank allocated, and after the
    last that every collective ran: a failure anywhere stops every rank before the same
    collective, none left waiting in a gather the others never join. A failure is logged once at
    WARNING on every rank; the first real call then builds what is missing."""
    processor, lm_head, group = exchange.processor, exchange.lm_head, get_parallel().tp_group
    width, device = exchange.layout.shard_width, lm_head.weight.device
    if exchange.role is DRAFT:
        fp32 = processor.use_fp32_lm_head or processor.use_fp32_lm_head_output
        steps = [(torch.float32 if fp32 else lm_head.weight.dtype, 1)]
        what = "the draft logits gather"
    else:
        dtypes = logits_dtypes(processor, lm_head)
        steps = itertools.product(dtypes, FULL_LOGITS_WARM_UP_ROWS)
        what = "the target verify's full-logits path"
    reason = None
    for dtype, rows in steps:
        try:
            shard = torch.zeros((rows, width), dtype=dtype, device=device)
            buffer = None
            if exchange.role is VERIFY:
                buffer = torch.empty(
                    (rows, processor.vocab_size), dtype=BUFFER_DTYPE, device=device
                )
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        reason = _agreed(group, reason)
        if reason is not None:
            break
        try:
            if buffer is None:
                sglang_surface.gather_logits(processor, shard)
            else:
                _gather_and_cast(processor, shard, buffer)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    reason = _agreed(group, reason)
    if reason is not None:
        log_once(
            logging.WARNING,
            ("exchange-warm-up", what, reason),
            "sglang_dsa_mtp: preparing %s ahead failed (%s); its first call builds it instead",
            what,
            reason,
        )


def _agreed(group, reason: Optional[str]) -> Optional[str]:
    agreed = agree_across_group(group, reason)
    if reason is None and agreed is not None:
        return "it failed on another TP rank (its reason is in its log)"
    return agreed


# --- the hand-off ---------------------------------------------------------------------------------


@dataclass
class HandOff:
    """What crosses between hooks outside SGLang's objects (the module docstring says why), one
    process-wide instance, :data:`HANDOFF`:

    - ``draft``, ``verify``: each role's engaged exchange, set by :func:`opt_in` when it engages
      (the last one engaged, where a process engages several: tests do). The picks ask it whether a
      tensor SGLang hands them is its own (a stand-in; a kept shard).
    - ``extend_pick_asked``, ``extend_pick``: set to True and None by the AROUND hook on
      ``_draft_extend_for_decode`` while SGLang's method runs; the replay hook inside it then picks
      from the partials into ``extend_pick`` (``(topk_p, topk_index)``), which the outer hook
      stores in the next draft input. Both cleared in its ``finally``.
    - ``verify_predict``: set by the AROUND hook on ``eagle_sample`` while SGLang's verify of a
      greedy batch runs (the exchanged argmax, int64 ``[rows, 1]``), read by the hook on
      ``verify_tree_greedy_func`` inside it; cleared in its ``finally``.
    """

    draft: Optional[VocabShardExchange] = None
    verify: Optional[VocabShardExchange] = None
    extend_pick_asked: bool = False
    extend_pick: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    verify_predict: Optional[torch.Tensor] = None


HANDOFF = HandOff()


# --- the opt-in: the ranks agree, the state is set ------------------------------------------------


@dataclass
class Decision:
    """What one opt-in decided for ``role``, and the facts it decided on (for its one log line)."""

    role: Role
    reason: Optional[str] = None  # why SGLang's path is kept; None when the exchange engaged
    facts: dict = field(default_factory=dict)

    @property
    def engaged(self) -> bool:
        return self.reason is None

    def line(self) -> str:
        facts = ", ".join(f"{name} {value}" for name, value in self.facts.items())
        if self.engaged:
            return f"{self.role.switch.feature} on: {self.role.on} ({facts})"
        return f"{self.role.switch.feature} off: {self.role.off}: {self.reason} ({facts})"

    def log(self) -> None:
        """The decision at INFO, once per process for each distinct line."""
        line = self.line()
        log_once(logging.INFO, ("argmax-exchange-opt-in", line), "sglang_dsa_mtp: %s", line)


def raised(role: Role, what: str, exc: Exception) -> str:
    """The reason an opt-in names when ``what`` raised ``exc`` (SGLang's path stays), logged once
    at ERROR."""
    log_failure(
        ("argmax-exchange-raised", role.name, what),
        exc,
        "sglang_dsa_mtp: %s keeps SGLang's path: %s raised",
        role.switch.feature,
        what,
    )
    return f"{what} raised {type(exc).__name__}: {exc}"


def opt_in(
    processor,
    lm_head,
    role: Role,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    capture_rows=None,
    draft_steps: Optional[int] = None,
    facts: Optional[dict] = None,
) -> Decision:
    """Opt ``processor`` in to the exchange in ``role``, or leave it on SGLang's path; returns the
    decision with its facts (after ``facts``, the caller's), unlogged.

    ``lm_head`` is the head the model passes to ``forward``; ``max_rows`` the most rows one call
    has; ``capture_rows`` the row counts of the captured graphs and ``draft_steps`` the draft-token
    columns the draft decode pick writes, both for compiling the kernels ahead. Collective: call
    it on every rank of the TP group, which settles on one answer. Engaged, the processor's
    ``ProcessorState`` and :data:`HANDOFF` hold the exchange for ``role`` and its logits tail has
    run ahead (:func:`_warm_up_tail`); otherwise the state's field is None.
    The conditions: docs/switches.md, "When the processor engages" and its target-verify twin."""
    decision = Decision(role, facts=dict(facts or {}))
    rows = sorted({1, max(1, int(max_rows)), *(int(r) for r in capture_rows or ())})
    exchange = None
    try:
        group = get_parallel().tp_group
    except Exception as exc:  # no TP group to exchange over, nor to agree with
        decision.reason = f"no TP group ({type(exc).__name__}: {exc})"
    else:
        decision.facts["tp size"] = group.world_size
        decision.facts.update(head_facts(lm_head))
        try:
            reason = _local_blocker(
                processor, lm_head, role, group, rows, draft_steps, decision.facts
            )
        except Exception as exc:  # never take the server down: SGLang's path stays
            reason = raised(role, "the opt-in check", exc)
        decision.reason = agree_across_group(group, reason)  # every rank gets here
        if decision.engaged:
            exchange = VocabShardExchange(
                role, processor, lm_head, group, decision.facts.get("all-reduce")
            )
    setattr(state_of(processor, ProcessorState), role.name, exchange)
    if exchange is not None:
        setattr(HANDOFF, role.name, exchange)
        _warm_up_tail(exchange)
    return decision


def enable_draft_argmax_exchange(
    self,
    lm_head,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    capture_rows=None,
    draft_steps: Optional[int] = None,
) -> bool:
    """Opt this (draft model's) ``LogitsProcessor`` in to the greedy-draft argmax exchange.

    ``lm_head`` is the head the model passes to ``forward``; ``max_rows`` the most rows one call
    has (the largest captured batch); ``capture_rows`` the row counts of the captured graphs and
    ``draft_steps`` the draft-token columns the draft decode pick writes, both for compiling the
    kernels ahead (optional). Engages, and returns True, only when every condition holds: the kill
    switch is on; the processor gathers vocab-parallel logits over the TP group (tp > 1, no DP
    attention, no DP LM head, no LM-head all-to-all, no final-logit softcapping); SGLang's LM-head
    path for ``lm_head`` is a plain bf16/fp32 matmul (a ``ParallelLMHead`` whose quant method, if
    any, SGLang does not apply, no LoRA, no bias, no added vocab, rank r owning the r-th contiguous
    shard); SGLang's TP all-reduce of the exchange buffer, for 1 and ``max_rows`` rows, would not
    run on NCCL inside a CUDA-graph capture; and every kernel variant compiled ahead (scratch
    tensors only). Otherwise the processor keeps the gather. The decision and its facts are logged
    once at INFO. Collective: call it on every rank of the TP group, which settles on one answer
    for all ranks.
    """
    decision = opt_in(
        self, lm_head, DRAFT, max_rows=max_rows, capture_rows=capture_rows, draft_steps=draft_steps
    )
    decision.log()
    return decision.engaged


# --- the processor's hooks ------------------------------------------------------------------------


def exchange_logits(
    original, self, hidden_states, lm_head, logits_metadata, embedding_bias=None, **kwargs
):
    """AROUND ``LogitsProcessor._get_logits``: an engaged target's target verify keeps its shard
    (or, without a usable logits buffer, keeps SGLang's full logits, saying why once); an engaged
    draft's greedy-draft call returns the exchange behind a stand-in; every other call is SGLang's.
    """
    state = peek(self, ProcessorState)
    verify, draft = state.verify, state.draft
    if verify is not None and verify.takes(lm_head, logits_metadata, embedding_bias):
        buffer = logits_metadata.next_token_logits_buffer
        if not kwargs.get("use_logits_buffer", True):
            buffer = None
        why = verify.buffer_blocker(buffer, hidden_states.shape[0])
        if why is None:
            return verify.keep(hidden_states, buffer)
        log_once(
            logging.INFO,
            ("verify-exchange-no-buffer", why),
            "sglang_dsa_mtp: verify_argmax_exchange: a target verify keeps SGLang's full logits: %s",
            why,
        )
    elif draft is not None and draft.takes(lm_head, logits_metadata, embedding_bias):
        return draft.exchange(hidden_states)
    return original(self, hidden_states, lm_head, logits_metadata, embedding_bias, **kwargs)


def attach_partials(result, self, *args, **kwargs):
    """AFTER ``LogitsProcessor.forward``: name the exchange buffer in the output when there is one."""
    draft = peek(self, ProcessorState).draft
    if draft is not None and result is not None:
        exchange = draft.exchange_rows(result.next_token_logits)
        if exchange is not None:
            result.next_token_argmax_partials = exchange
    return result
