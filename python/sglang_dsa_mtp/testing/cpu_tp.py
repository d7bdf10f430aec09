"""SGLang 0.5.23's real LM-head logits path in a tensor-parallel group of CPU processes (gloo).

* :func:`sglang_parallel_groups`: inside a process started by
  :func:`sglang_dsa_mtp.testing.process_group.run_group`, publishes a dummy SGLang config with
  ``tp_size=world`` and the given server args, sets SGLang's all-reduce switches from it, builds
  SGLang's distributed environment and model-parallel groups, and tears them down on exit;
  :func:`sglang_tp_group` is its CPU (gloo) form (the GPU form is
  :func:`sglang_dsa_mtp.testing.sglang_gpu_tp.sglang_gpu_tp_group`).
* :func:`build_lm_head`: a vocab-parallel ``ParallelLMHead`` holding this rank's shard of a seeded
  full weight, and a ``LogitsProcessor`` that all-gathers the logits over the TP group;
  :func:`build_shared_draft_head`: the same for a quantized checkpoint's NextN draft head, built and
  given the target's weight as SGLang does.
* :func:`logits_forward`: ``LogitsProcessor.forward`` with a real ``LogitsMetadata`` (decode or
  draft-extend-v2, no logprobs).
* :func:`reference_logits`: the gathered logits recomputed shard by shard, as SGLang computes them.
* :func:`exchange_on_off_worker`: body of the two-process CPU test of the draft argmax exchange.

SGLang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_dsa_mtp.devices import select_device

FORWARD_MODES = ("decode", "draft_extend_v2")
# The quantized checkpoint the TP test deploys: the spec's model's kind, ModelOpt NVFP4, whose NextN
# draft head keeps ModelOptFp4LinearMethod and takes the target's bf16 weight.
QUANTIZED_CHECKPOINT = "modelopt_fp4"


@contextlib.contextmanager
def sglang_parallel_groups(
    rank: int,
    world: int,
    init_method: str,
    *,
    backend: str,
    server_args: Optional[dict] = None,
    group_kwargs: Optional[dict] = None,
):
    """SGLang's distributed environment and model-parallel groups, built as SGLang builds them.

    Publishes a dummy SGLang config with ``tp_size=world`` and ``server_args`` (real
    ``ServerArgs`` fields, e.g. ``disable_custom_all_reduce=True``) through
    ``get_context().override_server_args``; overrides ``tp_rank`` (the override publishes no
    ranks); sets SGLang's all-reduce switches from that config with SGLang's own
    ``bootstrap._set_all_reduce_flags`` (``set_custom_all_reduce``, ``set_mscclpp``,
    ``set_torch_symm_mem_all_reduce``, FlashInfer's all-reduce-only tag), restoring them on exit;
    then ``init_distributed_environment(backend=backend)`` with ``local_rank=rank`` and
    ``initialize_model_parallel(backend=backend, enable_symm_mem=...)`` as
    ``bootstrap._init_parallel_groups`` calls them. ``group_kwargs`` are forced on every group
    ``initialize_model_parallel`` builds (the CPU harness turns pynccl and the custom all-reduce
    off). Yields SGLang's TP ``GroupCoordinator``; on exit the groups, WORLD and the process group
    are destroyed and the previous config is restored.
    """
    from sglang.srt.distributed import bootstrap, parallel_state
    from sglang.srt.runtime_context import get_context, get_exec, get_parallel

    build_group = parallel_state.init_model_parallel_group

    def build_forced_group(*args, **kwargs):
        kwargs.update(group_kwargs)
        return build_group(*args, **kwargs)

    flags = [
        "_ENABLE_CUSTOM_ALL_REDUCE",
        "_ENABLE_MSCCLPP",
        "_ENABLE_TORCH_SYMM_MEM_ALL_REDUCE",
        "_ENABLE_FLASHINFER_ALLREDUCE_ONLY",
    ]
    saved_flags = {name: getattr(parallel_state, name) for name in flags}
    override = get_context().override_server_args(tp_size=world, **(server_args or {}))
    override.install()
    try:
        with get_parallel().override(tp_rank=rank):
            try:
                bootstrap._set_all_reduce_flags()
                parallel_state.init_distributed_environment(
                    world_size=world,
                    rank=rank,
                    local_rank=rank,
                    distributed_init_method=init_method,
                    backend=backend,
                )
                if group_kwargs:
                    parallel_state.init_model_parallel_group = build_forced_group
                try:
                    parallel_state.initialize_model_parallel(
                        backend=backend, enable_symm_mem=get_exec().comm.enable_symm_mem
                    )
                finally:
                    parallel_state.init_model_parallel_group = build_group
                yield get_parallel().tp_group
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
                for name, value in saved_flags.items():
                    setattr(parallel_state, name, value)
    finally:
        override.restore()


@contextlib.contextmanager
def sglang_tp_group(rank: int, world: int, init_method: str):
    """SGLang's TP group of ``world`` CPU processes on gloo, this process being ``rank``.

    Call it first in a spawned child: it selects the device (``TRITON_INTERPRET=1`` without CUDA)
    before anything imports SGLang or Triton. Yields SGLang's TP ``GroupCoordinator``, built by
    :func:`sglang_parallel_groups` on gloo with ``use_pynccl=False, use_custom_allreduce=False``
    forced on every group (a CUDA build of torch finds libnccl and PyNccl then asks for a CUDA
    device; the custom all-reduce only warns). ``LOCAL_SIZE`` is dropped from the environment so
    that SGLang's CPU shared-memory collectives (``sgl_kernel.shm_*``) stay off and CPU tensors go
    through gloo.
    """
    if select_device().type != "cpu":
        raise RuntimeError("sglang_tp_group builds a CPU (gloo) group; this machine has CUDA")
    os.environ.pop("LOCAL_SIZE", None)
    with sglang_parallel_groups(
        rank,
        world,
        init_method,
        backend="gloo",
        group_kwargs=dict(use_pynccl=False, use_custom_allreduce=False),
    ) as group:
        yield group


def full_lm_head_weight(vocab_size: int, hidden: int, *, dtype: torch.dtype, seed: int):
    """The seeded ``[vocab_size, hidden]`` weight (normal times 0.05, then ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab_size, hidden, generator=gen) * 0.05).to(dtype)


def logits_processor(
    vocab_size: int,
    *,
    logit_scale: Optional[float] = None,
    final_logit_softcapping: Optional[float] = None,
):
    """SGLang's ``LogitsProcessor(SimpleNamespace(vocab_size=...[, final_logit_softcapping=...]),
    logit_scale=logit_scale)``, inside an SGLang TP group."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    config = SimpleNamespace(vocab_size=vocab_size)
    if final_logit_softcapping is not None:
        config.final_logit_softcapping = final_logit_softcapping
    return LogitsProcessor(config, logit_scale=logit_scale)


def build_lm_head(
    vocab_size: int,
    hidden: int,
    *,
    dtype: torch.dtype,
    seed: int,
    logit_scale: Optional[float] = None,
    final_logit_softcapping: Optional[float] = None,
    device: Optional[torch.device] = None,
):
    """``(lm_head, processor, full_weight)``, inside an SGLang TP group.

    ``full_weight`` is :func:`full_lm_head_weight` (the same on every rank, on the CPU). The head is
    built on ``device`` (default: torch's default device) and its shard is loaded from
    ``full_weight`` by SGLang's ``weight_loader``, which zeroes the padding rows. The processor is
    :func:`logits_processor`. A softcapped forward cannot run under Triton's interpreter: SGLang
    softcaps CPU logits with a Triton kernel (``is_cpu()`` is False without
    ``SGLANG_USE_CPU_ENGINE=1``) that calls ``libdevice.tanh``, which the interpreter of Triton 3.8
    does not implement.
    """
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    full_weight = full_lm_head_weight(vocab_size, hidden, dtype=dtype, seed=seed)
    with contextlib.nullcontext() if device is None else torch.device(device):
        lm_head = ParallelLMHead(vocab_size, hidden, params_dtype=dtype)
    lm_head.weight.weight_loader(lm_head.weight, full_weight)
    processor = logits_processor(
        vocab_size, logit_scale=logit_scale, final_logit_softcapping=final_logit_softcapping
    )
    return lm_head, processor, full_weight


def build_shared_draft_head(
    checkpoint: str,
    vocab_size: int,
    hidden: int,
    *,
    dtype: torch.dtype,
    seed: int,
    tie: Optional[tuple[int, int]] = None,
):
    """``(lm_head, processor, full_weight)`` of a NextN draft deployed from ``checkpoint``
    (:mod:`sglang_dsa_mtp.testing.deployment`), inside :func:`sglang_tp_group`: the target's head loads
    its shard of :func:`full_lm_head_weight` (column ``tie[0]`` a copy of ``tie[1]``), and SGLang's
    draft worker gives its weight to the draft's head, which keeps the quant method the
    checkpoint's config gave it. The processor is the draft model's ``LogitsProcessor(config)``."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    from sglang_dsa_mtp.testing import deployment

    full_weight = full_lm_head_weight(vocab_size, hidden, dtype=dtype, seed=seed)
    if tie is not None:
        full_weight[tie[0]] = full_weight[tie[1]]
    target_head, draft_head = deployment.lm_heads(checkpoint, vocab_size, hidden, dtype=dtype)
    target_head.weight.weight_loader(target_head.weight, full_weight)
    config = SimpleNamespace(vocab_size=vocab_size)
    _, draft, _ = deployment.share_target_head(
        checkpoint,
        target_head,
        draft_head,
        dtype=dtype,
        target_processor=LogitsProcessor(config),
        draft_processor=LogitsProcessor(config),
    )
    return draft.lm_head, draft.logits_processor, full_weight


def logits_metadata(mode: str, select_index: Optional[torch.Tensor] = None):
    """A real ``LogitsMetadata`` for ``mode`` (see :func:`logits_forward`)."""
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if mode == "decode":
        if select_index is not None:
            raise ValueError("select_index is for mode 'draft_extend_v2'")
        return LogitsMetadata(forward_mode=ForwardMode.DECODE)
    if mode == "draft_extend_v2":
        return LogitsMetadata(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, draft_extend_select_index=select_index
        )
    raise ValueError(f"mode must be one of {FORWARD_MODES}, got {mode!r}")


def logits_forward(
    processor,
    lm_head,
    hidden_states: torch.Tensor,
    *,
    mode: str,
    select_index: Optional[torch.Tensor] = None,
):
    """The ``LogitsProcessorOutput`` of ``processor.forward(input_ids, hidden_states, lm_head,
    metadata)``. ``mode``: ``"decode"`` or ``"draft_extend_v2"`` (``select_index`` then picks the
    rows that get logits, or None for all). No logprobs; ``input_ids`` are zeros (unread)."""
    metadata = logits_metadata(mode, select_index)
    input_ids = torch.zeros(hidden_states.shape[0], dtype=torch.int64, device=hidden_states.device)
    return processor.forward(input_ids, hidden_states, lm_head, metadata)


def shard_logits(
    hidden_states: torch.Tensor,
    full_weight: torch.Tensor,
    rank: int,
    shard_width: int,
    *,
    logit_scale: Optional[float] = None,
) -> torch.Tensor:
    """Rank ``rank``'s LM-head logits as SGLang computes them: ``hidden`` times the rank's
    ``[shard_width, hidden]`` slice of ``full_weight`` zero-padded past the vocab, in the weight's
    dtype, times ``logit_scale`` in that dtype."""
    vocab_size, hidden = full_weight.shape
    shard = torch.zeros(shard_width, hidden, dtype=full_weight.dtype)
    rows = full_weight[rank * shard_width : (rank + 1) * shard_width]
    shard[: rows.shape[0]] = rows
    logits = torch.matmul(hidden_states.to(full_weight.dtype), shard.T)
    if logit_scale is not None:
        logits.mul_(logit_scale)
    return logits


def reference_logits(
    hidden_states: torch.Tensor,
    full_weight: torch.Tensor,
    world: int,
    shard_width: int,
    *,
    logit_scale: Optional[float] = None,
) -> torch.Tensor:
    """fp32 ``[rows, vocab_size]``: SGLang's gathered logits, every rank's :func:`shard_logits`
    concatenated, sliced to the vocab, then fp32 (no softcap)."""
    parts = [
        shard_logits(hidden_states, full_weight, rank, shard_width, logit_scale=logit_scale)
        for rank in range(world)
    ]
    return torch.cat(parts, dim=-1)[:, : full_weight.shape[0]].float()


def _bits_differ(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when ``got`` and ``want`` are bit-identical fp32 tensors of one shape, else why not."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    differ = got.contiguous().view(torch.int32) != want.contiguous().view(torch.int32)
    if not bool(differ.any()):
        return None
    where = differ.nonzero()[0].tolist()
    diff = (got.double() - want.double()).abs().max().item()
    return f"{int(differ.sum())} elements differ (first at {where}, max abs diff {diff:.3g})"


def sglang_pick(
    output,
    mode: str,
    positions: Optional[torch.Tensor] = None,
    draft_tokens: Optional[torch.Tensor] = None,
) -> dict:
    """SGLang's greedy draft pick from the output's (gathered) logits, or the plugin's from its
    partials: draft decode through ``draft_topk1_postprocess`` (hooked by the plugin; it advances
    ``positions`` and writes draft-token column 1; default: fresh ones, positions ``5 + 3 * row``),
    draft extend as SGLang's CUDA path does (``torch.argmax``) or from the partials
    (``propagate``)."""
    from sglang.kernels.ops.speculative import topk1

    from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import (
        draft_argmax_finalize,
    )

    if mode == "decode":
        rows, device = output.next_token_logits.shape[0], output.next_token_logits.device
        if positions is None:
            positions = (torch.arange(rows, dtype=torch.int64) * 3 + 5).to(device)
        if draft_tokens is None:
            draft_tokens = torch.full((rows, 3), -7, dtype=torch.int64, device=device)
        topk_p, topk_index = topk1.draft_topk1_postprocess(
            output.next_token_logits, positions, draft_tokens, 1
        )
        return dict(
            topk_p=topk_p, topk_index=topk_index, positions=positions, draft_tokens=draft_tokens
        )
    if output.next_token_argmax_partials is not None:
        _, topk_index = draft_argmax_finalize(
            output.next_token_argmax_partials, nan_policy="propagate"
        )
    else:
        topk_index = torch.argmax(output.next_token_logits, dim=-1, keepdim=True)
    return dict(topk_index=topk_index)


def exchange_on_off_worker(
    rank: int,
    world: int,
    init_method: str,
    result_dir: str,
    vocab_size: int = 1001,
    hidden: int = 64,
    logit_scale: float = 0.37,
) -> None:
    """Body of the CPU TP test of the draft argmax exchange; writes ``rank<r>.json``.

    In :func:`sglang_tp_group`, with the plugin registered and its hooks applied by SGLang's
    ``HookRegistry``: ``get_parallel().tp_group.all_reduce`` of fp32 and bf16 CPU tensors against the
    sum; the opt-in's cross-rank agreement (a reason on one rank reaches every rank); then for bf16
    and fp32, with and without ``logit_scale``, and for the bf16 draft head of
    :data:`QUANTIZED_CHECKPOINT` (:func:`build_shared_draft_head`):

    * exchange off: the head's shard against the full weight, ``next_token_logits`` of decode (rows
      1..5) and draft extend (8 rows, ``select_index`` [7, 0, 3, 3]) bit for bit against
      :func:`reference_logits`, and SGLang's pick from them;
    * ``enable_draft_argmax_exchange`` engages (route: CPU all-reduce);
    * exchange on: the same forwards return ``next_token_argmax_partials``, and the picks from them
      (tokens, ``topk_p``, positions, draft tokens) equal SGLang's.

    Column 700 (rank 1's shard) repeats column 5's weight and row 0 of every batch points at it:
    a cross-rank tie that the lower column must win. Last, rank 1's opt-in check raises: both ranks
    still agree, on keeping the gather (each rank's reason in the report).
    """
    start = time.monotonic()
    report = {"rank": rank, "world": world, "checked": 0, "failures": [], "all_reduce": []}
    failures = report["failures"]
    try:
        with sglang_tp_group(rank, world, init_method) as tp_group:
            from sglang.srt.plugins.hook_registry import HookRegistry
            from sglang.srt.runtime_context import get_parallel

            from sglang_dsa_mtp import plugin
            from sglang_dsa_mtp.integration.draft_argmax_exchange import exchange_state
            from sglang_dsa_mtp.integration.tp_all_reduce import agree_across_group

            plugin.register()
            HookRegistry.apply_hooks()
            report["group"] = dict(world_size=tp_group.world_size, rank=tp_group.rank_in_group)
            report["setup_s"] = round(time.monotonic() - start, 2)
            for dtype in (torch.float32, torch.bfloat16):
                base = torch.arange(1, 13, dtype=torch.float32).view(3, 4) * 0.25
                mine = (base * (rank + 1)).to(dtype)
                out = get_parallel().tp_group.all_reduce(mine)
                want = (base * (world * (world + 1) // 2)).to(dtype)
                report["all_reduce"].append(dict(dtype=str(dtype), sum_ok=torch.equal(out, want)))
            report["agreed"] = agree_across_group(
                tp_group, "only rank 1 objects" if rank == 1 else None
            )

            heads = [
                (dtype, scale, None)
                for dtype in (torch.bfloat16, torch.float32)
                for scale in (None, logit_scale)
            ]
            heads.append((torch.bfloat16, None, QUANTIZED_CHECKPOINT))
            for dtype, scale, checkpoint in heads:
                where = f"{dtype}, logit_scale {scale}, checkpoint {checkpoint}"
                if checkpoint is None:
                    lm_head, processor, full_weight = build_lm_head(
                        vocab_size, hidden, dtype=dtype, seed=11, logit_scale=scale
                    )
                    full_weight[700] = full_weight[5]
                    lm_head.weight.weight_loader(lm_head.weight, full_weight)
                else:
                    lm_head, processor, full_weight = build_shared_draft_head(
                        checkpoint, vocab_size, hidden, dtype=dtype, seed=11, tie=(700, 5)
                    )
                    report["quantized"] = dict(
                        checkpoint=checkpoint,
                        quant_method=type(lm_head.quant_method).__name__,
                        weight_dtype=str(lm_head.weight.dtype),
                    )
                width = lm_head.num_embeddings_per_partition
                report["flags"] = dict(
                    do_tensor_parallel_all_gather=processor.do_tensor_parallel_all_gather,
                    use_attn_tp_group=processor.use_attn_tp_group,
                    do_tensor_parallel_all_gather_dp_attn=(
                        processor.do_tensor_parallel_all_gather_dp_attn
                    ),
                )
                report["shard_width"] = width
                padded = torch.zeros(world * width, hidden, dtype=dtype)
                padded[:vocab_size] = full_weight
                if not torch.equal(lm_head.weight.data, padded[rank * width : (rank + 1) * width]):
                    failures.append(f"{where}: the loaded shard differs from the full weight")

                cases = [("decode", rows, None) for rows in range(1, 6)]
                cases.append(("draft_extend_v2", 8, torch.tensor([0, 7, 3, 3])))
                batches, picks = [], []
                for mode, rows, select_index in cases:
                    gen = torch.Generator().manual_seed(1000 * rows + len(mode))
                    states = torch.randn(rows, hidden, generator=gen).to(dtype)
                    states[0] = full_weight[5].float().mul(40.0).to(dtype)
                    batches.append(states)
                    output = logits_forward(
                        processor, lm_head, states, mode=mode, select_index=select_index
                    )
                    picked = states if select_index is None else states[select_index]
                    want = reference_logits(picked, full_weight, world, width, logit_scale=scale)
                    problem = _bits_differ(output.next_token_logits, want)
                    if problem:
                        failures.append(f"{where}, {mode}, {rows} rows: {problem}")
                    picks.append(sglang_pick(output, mode))
                    if int(picks[-1]["topk_index"][0]) != 5:
                        failures.append(f"{where}, {mode}: row 0 did not pick column 5")

                if not processor.enable_draft_argmax_exchange(lm_head, max_rows=8):
                    failures.append(f"{where}: the exchange did not engage")
                    continue
                report["route"] = exchange_state(processor).route
                for (mode, rows, select_index), states, expected in zip(cases, batches, picks):
                    output = logits_forward(
                        processor, lm_head, states, mode=mode, select_index=select_index
                    )
                    if output.next_token_argmax_partials is None:
                        failures.append(f"{where}, {mode}, {rows} rows: no partials")
                        continue
                    ours = sglang_pick(output, mode)
                    for name, value in expected.items():
                        if value.dtype != ours[name].dtype or not torch.equal(value, ours[name]):
                            failures.append(
                                f"{where}, {mode}, {rows} rows: {name} {ours[name].tolist()}"
                                f", SGLang's {value.tolist()}"
                            )
                    report["checked"] += 1

            # One rank's opt-in check fails: every rank still agrees, and keeps the gather.
            from sglang_dsa_mtp.integration import draft_argmax_exchange as site

            lm_head, processor, _ = build_lm_head(vocab_size, hidden, dtype=dtype, seed=12)
            if rank == 1:

                def broken(*args):
                    raise RuntimeError("rank 1 cannot tell")

                site._local_blocker = broken
            decision = site.opt_in(processor, lm_head)
            report["reason_when_rank_1_fails"] = decision.reason
            report["engaged_when_rank_1_fails"] = site.exchange_state(processor) is not None
    finally:
        report["seconds"] = round(time.monotonic() - start, 2)
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures[:20]))
