"""The target and MTP draft LM heads of a deployment and their logits path, as SGLang 0.5.23 builds
and runs them, on any device.

SGLang's start-up, for the LM heads of a DeepSeek-V3.2 / GLM-5 MTP deployment:

1. the loader turns the checkpoint's ``quantization_config`` into a quant config per model class
   (``get_quant_config`` with the class's ``packed_modules_mapping``, then the class's weight-name
   mapper: :func:`quant_config_for`);
2. the target model builds ``lm_head = ParallelLMHead(vocab, hidden, quant_config=...,
   prefix="lm_head")``, the NextN draft model ``ParallelLMHead(..., prefix=
   "model.shared_head.head")``, in the model dtype (:func:`lm_heads`);
3. both load their weights, then the loader's ``postprocess_weights`` runs every quant method's
   load step;
4. the EAGLE v2 draft worker's ``init_lm_head`` gives the draft the target's embedding and head
   weight (``set_embed_and_head``): :func:`share_target_head`.

:data:`CHECKPOINTS` holds the checkpoints the tests deploy, by name. Inside an SGLang TP group
(:mod:`support.tp`): :func:`build_lm_head` (a vocab-parallel head holding its shard
of a seeded full weight, and its ``LogitsProcessor``), :func:`build_shared_draft_head` (a
checkpoint's NextN draft head given the target's weight by SGLang's EAGLE draft worker, which
:func:`build_draft_worker` returns), :func:`logits_forward` (the processor's forward with a real
``LogitsMetadata``) and :func:`sglang_pick` (SGLang's greedy draft pick, or the
plugin's from its partials); :func:`reference_logits` recomputes the gathered logits shard by shard
apart from SGLang, and :func:`bits_differ` compares them bit for bit. SGLang is imported inside the
functions only.
"""

from __future__ import annotations

import contextlib
import pkgutil
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import torch

# The models: (SGLang's target class, its NextN draft class, num_hidden_layers: the MTP layer's index).
MODELS = {
    "deepseek_v32": (
        "sglang.srt.models.deepseek_v2:DeepseekV32ForCausalLM",
        "sglang.srt.models.deepseek_nextn:DeepseekV3ForCausalLMNextN",
        61,
    ),
    "glm5": (
        "sglang.srt.models.glm4_moe:GlmMoeDsaForCausalLM",
        "sglang.srt.models.glm4_moe:GlmMoeDsaForCausalLMNextN",
        78,
    ),
}

# ModelOpt NVFP4 in config.json's flat form, shaped like ModelOpt's GLM-5.x exports (not copied from
# one): the LM head and the MTP layer stay bf16. SGLang names the draft's head
# "model.shared_head.head", which no pattern here names, so it gets ModelOpt's FP4 linear method
# (and then the target's bf16 weight).
_MODELOPT_NVFP4 = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "dynamic": False,
                "num_bits": 4,
                "type": "float",
                "group_size": 16,
            },
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"],
        }
    },
    "ignore": ["lm_head", "model.layers.0.self_attn*", "model.layers.78*"],
    "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.39.0"},
    "quant_algo": "NVFP4",
    "quant_method": "modelopt",
}
_MODELOPT_FP8 = {
    "ignore": ["lm_head", "model.layers.78*"],
    "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    "producer": {"name": "modelopt", "version": "0.39.0"},
    "quant_algo": "FP8",
    "quant_method": "modelopt",
}

# Checkpoints: (model, SGLang's --quantization for it, the checkpoint's quantization_config).
CHECKPOINTS = {
    "unquantized": ("deepseek_v32", None, None),
    # DeepSeek-V3.2's config.json: block FP8, which leaves every ParallelLMHead unquantized.
    "fp8_block": (
        "deepseek_v32",
        "fp8",
        {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    ),
    "modelopt_fp4": ("glm5", "modelopt_fp4", _MODELOPT_NVFP4),
    "modelopt_fp4_head_excluded": (
        "glm5",
        "modelopt_fp4",
        {**_MODELOPT_NVFP4, "ignore": [*_MODELOPT_NVFP4["ignore"], "*shared_head.head"]},
    ),
    "modelopt_fp8": ("glm5", "modelopt_fp8", _MODELOPT_FP8),
    # ModelOpt FP8 with the LM heads quantized too: the draft takes the target's FP8 weight, and
    # SGLang runs ModelOpt's FP8 LM-head kernel on it.
    "modelopt_fp8_quantized_lm_head": (
        "glm5",
        "modelopt_fp8",
        {**_MODELOPT_FP8, "ignore": ["model.layers.78*"]},
    ),
}
# ModelOpt's NVFP4 linear method cannot run its load step without a GPU (it needs an SM100 GPU or
# the Marlin backend), so these checkpoints skip it on a CPU. The step repacks the FP4 weight and
# its scales, which the draft head gives up when it takes the target's bf16 weight.
NO_CPU_LOAD_STEP = {"modelopt_fp4"}


def quant_config_for(
    model_class: type, quantization: Optional[str], quantization_config: Optional[dict]
):
    """SGLang's quant config for ``model_class`` from a checkpoint's ``quantization_config``: its
    ``get_quant_config`` with the class's ``packed_modules_mapping``, then the class's weight-name
    mapper, as ``_get_quantization_config`` does when SGLang loads a model. None: unquantized."""
    if quantization is None:
        return None
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from transformers import PretrainedConfig

    model_config = SimpleNamespace(
        quantization=quantization,
        hf_config=PretrainedConfig(quantization_config=quantization_config),
        is_draft_model=False,
        is_draft_quantization_explicit=False,
        model_path="unused: the quantization_config is in the config",
        revision=None,
    )
    packed = getattr(model_class, "packed_modules_mapping", {})
    quant_config = get_quant_config(model_config, SimpleNamespace(download_dir=None), packed)
    get_mapper = getattr(model_class, "get_hf_to_sglang_mapper", None)
    if get_mapper is not None:
        mapper = get_mapper(model_config.hf_config)
    else:
        mapper = getattr(model_class, "hf_to_sglang_mapper", None)
    if mapper is not None:
        quant_config.apply_weight_name_mapper(mapper)
    return quant_config


def model_classes(checkpoint: str) -> tuple[type, type, int]:
    """(target class, NextN draft class, num_hidden_layers) of ``checkpoint``'s model."""
    target, draft, num_layers = MODELS[CHECKPOINTS[checkpoint][0]]
    return pkgutil.resolve_name(target), pkgutil.resolve_name(draft), num_layers


def lm_heads(
    checkpoint: str,
    vocab_size: int,
    hidden: int,
    *,
    dtype: torch.dtype,
    added_vocab: int = 0,
    use_attn_tp_group: bool = False,
):
    """(target ``lm_head``, draft ``model.shared_head.head``) of ``checkpoint``, as the target model
    and the NextN draft build them in model dtype ``dtype``, under the current parallel context;
    weights not loaded. ``added_vocab`` > 0 gives both heads that many added (LoRA) entries."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    _, quantization, quantization_config = CHECKPOINTS[checkpoint]
    target_class, draft_class, _ = model_classes(checkpoint)
    heads = []
    for model_class, prefix in ((target_class, "lm_head"), (draft_class, "model.shared_head.head")):
        quant_config = quant_config_for(model_class, quantization, quantization_config)
        with set_default_torch_dtype(dtype):
            heads.append(
                ParallelLMHead(
                    vocab_size + added_vocab,
                    hidden,
                    org_num_embeddings=vocab_size,
                    quant_config=quant_config,
                    prefix=prefix,
                    use_attn_tp_group=use_attn_tp_group,
                )
            )
    return tuple(heads)


def _model(model_class: type, *, embed_tokens, lm_head, logits_processor):
    """A real SGLang model class instance holding only its embedding, head and processor (the
    layers are not built: the LM-head path reads none of them)."""
    model = object.__new__(model_class)
    torch.nn.Module.__init__(model)
    model.model = torch.nn.Module()
    model.model.embed_tokens = embed_tokens
    model.lm_head = lm_head
    model.logits_processor = logits_processor
    return model


def share_target_head(
    checkpoint: str, target_head, draft_head, *, dtype, target_processor, draft_processor
):
    """SGLang's steps 3 (load step) and 4 (weight sharing) for the heads of :func:`lm_heads` (model
    dtype ``dtype``), the target's loaded: returns ``(target model, draft model, worker)``, the draft model holding
    ``draft_head`` (now with the target's weight) and ``draft_processor``; ``worker`` is SGLang's
    ``EagleDraftWorker`` (built without a model runner) that ran ``init_lm_head``."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target_class, draft_class, _ = model_classes(checkpoint)
    device = target_head.weight.device

    def embedding():
        with set_default_torch_dtype(dtype):
            return VocabParallelEmbedding(draft_head.org_vocab_size, draft_head.embedding_dim)

    target = _model(
        target_class,
        embed_tokens=embedding(),
        lm_head=target_head,
        logits_processor=target_processor,
    )
    draft = _model(
        draft_class, embed_tokens=embedding(), lm_head=draft_head, logits_processor=draft_processor
    )
    if device.type != "cpu" or checkpoint not in NO_CPU_LOAD_STEP:
        for model in (target, draft):
            DefaultModelLoader.postprocess_weights(model, device)

    worker = object.__new__(EagleDraftWorker)
    worker.speculative_algorithm = SpeculativeAlgorithm.EAGLE
    worker.hot_token_id = None
    worker.draft_runner = SimpleNamespace(model=draft)
    worker.target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            model=target,
            model_config=SimpleNamespace(model_path="unused", revision=None),
            load_config=None,
        )
    )
    if device.type == "cpu":
        # set_embed_and_head ends with a device barrier, which has nothing to wait for here.
        with mock.patch.object(torch.cuda, "synchronize"):
            worker.init_lm_head()
    else:
        worker.init_lm_head()
    return target, draft, worker


# --- the LM heads and their logits path, inside an SGLang TP group ---------------------------------

FORWARD_MODES = ("decode", "draft_extend_v2", "target_verify")


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
    """``(lm_head, processor, full_weight)`` of a NextN draft deployed from ``checkpoint``, inside an
    SGLang TP group: the draft model's of :func:`build_draft_worker`."""
    worker, full_weight = build_draft_worker(
        checkpoint, vocab_size, hidden, dtype=dtype, seed=seed, tie=tie
    )
    draft = worker.draft_runner.model
    return draft.lm_head, draft.logits_processor, full_weight


def build_draft_worker(
    checkpoint: str,
    vocab_size: int,
    hidden: int,
    *,
    dtype: torch.dtype,
    seed: int,
    tie: Optional[tuple[int, int]] = None,
):
    """``(worker, full_weight)``: SGLang's ``EagleDraftWorker`` of a NextN draft deployed from
    ``checkpoint``, inside an SGLang TP group. The target's head (:func:`lm_heads`) loads its shard
    of :func:`full_lm_head_weight` (column ``tie[0]`` a copy of ``tie[1]``), and the worker gives
    its weight to the draft's head (:func:`share_target_head`), which keeps the quant method the
    checkpoint's config gave it. The draft model's processor is its ``LogitsProcessor(config)``.
    """
    from sglang.srt.layers.logits_processor import LogitsProcessor

    full_weight = full_lm_head_weight(vocab_size, hidden, dtype=dtype, seed=seed)
    if tie is not None:
        full_weight[tie[0]] = full_weight[tie[1]]
    target_head, draft_head = lm_heads(checkpoint, vocab_size, hidden, dtype=dtype)
    target_head.weight.weight_loader(target_head.weight, full_weight)
    config = SimpleNamespace(vocab_size=vocab_size)
    _, _, worker = share_target_head(
        checkpoint,
        target_head,
        draft_head,
        dtype=dtype,
        target_processor=LogitsProcessor(config),
        draft_processor=LogitsProcessor(config),
    )
    return worker, full_weight


def logits_metadata(
    mode: str,
    select_index: Optional[torch.Tensor] = None,
    logits_buffer: Optional[torch.Tensor] = None,
):
    """A real ``LogitsMetadata`` for ``mode`` (see :func:`logits_forward`)."""
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if mode not in FORWARD_MODES:
        raise ValueError(f"mode must be one of {FORWARD_MODES}, got {mode!r}")
    if select_index is not None and mode != "draft_extend_v2":
        raise ValueError("select_index is for mode 'draft_extend_v2'")
    if logits_buffer is not None and mode != "target_verify":
        raise ValueError("logits_buffer is for mode 'target_verify'")
    if mode == "decode":
        return LogitsMetadata(forward_mode=ForwardMode.DECODE)
    if mode == "draft_extend_v2":
        return LogitsMetadata(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, draft_extend_select_index=select_index
        )
    return LogitsMetadata(
        forward_mode=ForwardMode.TARGET_VERIFY, next_token_logits_buffer=logits_buffer
    )


def logits_forward(
    processor,
    lm_head,
    hidden_states: torch.Tensor,
    *,
    mode: str,
    select_index: Optional[torch.Tensor] = None,
    logits_buffer: Optional[torch.Tensor] = None,
):
    """The ``LogitsProcessorOutput`` of ``processor.forward(input_ids, hidden_states, lm_head,
    metadata)``. ``mode``: ``"decode"``, ``"draft_extend_v2"`` (``select_index`` then picks the
    rows that get logits, or None for all) or ``"target_verify"`` (``logits_buffer``: the fp32
    ``[rows, vocab]`` buffer SGLang's graph runner hands the call, or None). No logprobs;
    ``input_ids`` are zeros (unread)."""
    metadata = logits_metadata(mode, select_index, logits_buffer)
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


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when ``got`` and ``want`` are bit-identical tensors of one dtype and shape (compared as
    integers of the element's size: -0.0 differs from +0.0, a NaN equals the same NaN), else why
    not."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    as_int = _SAME_SIZE_INT[got.element_size()]
    differ = got.contiguous().view(as_int) != want.contiguous().view(as_int)
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
