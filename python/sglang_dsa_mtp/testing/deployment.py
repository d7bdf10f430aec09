"""An MTP draft head built as SGLang 0.5.23 builds it for a real checkpoint, on any device.

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

:data:`CHECKPOINTS` holds the checkpoints the tests deploy, by name. SGLang is imported inside the
functions only.
"""

from __future__ import annotations

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
