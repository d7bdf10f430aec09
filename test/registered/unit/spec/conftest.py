"""Fixtures for the greedy-draft argmax exchange on SGLang's real classes, in one CPU process.

``draft_head(...)`` builds an MTP deployment the way SGLang builds it, as TP rank 1 of 2: SGLang's
runtime config is published (``override_server_args``) and the parallel context names an
:class:`EmulatedPeerGroup` as the TP group. From a checkpoint's ``quantization_config``
(:data:`CHECKPOINTS`), SGLang's loader functions make the quant config of the target and of the
draft model class; the target's ``lm_head`` and the NextN draft's ``ParallelLMHead`` are built with
them, with the prefixes and arguments the two models use; the target head loads its shard of a full
weight through its ``weight_loader``; SGLang's ``postprocess_weights`` runs the quant methods' load
step; and SGLang's ``EagleDraftWorker.init_lm_head`` hands the target's head weight to the draft
(``set_embed_and_head``), as the draft worker does at start-up. The draft model's processor is
SGLang's ``LogitsProcessor``.

The group plays rank 0 from the full weight: its ``all_gather`` puts rank 0's shard logits before
ours (SGLang's gather) and its ``all_reduce`` adds rank 0's exchange buffer (the plugin's exchange),
so both paths see a whole vocabulary and can be compared with the gathered reference. SGLang is
imported inside the fixtures.
"""

import contextlib
import pkgutil
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import draft_argmax_partials
from sglang_dsa_mtp.test.cpu_tp import reference_logits, shard_logits

HIDDEN = 64

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

# ModelOpt NVFP4 as exported for GLM-5.x (config.json's flat form): the LM head and the MTP layer
# are left in bf16. The draft's head is "model.shared_head.head" in SGLang: no pattern of this list
# names it, so it gets ModelOpt's FP4 linear method (then the target's bf16 weight).
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
    # DeepSeek-V3.2's own config.json: block FP8, which leaves every ParallelLMHead unquantized.
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
    # ModelOpt FP8 with the LM heads quantized too: the draft takes the target's FP8 weight and
    # SGLang runs ModelOpt's FP8 LM-head kernel on it.
    "modelopt_fp8_quantized_lm_head": (
        "glm5",
        "modelopt_fp8",
        {**_MODELOPT_FP8, "ignore": ["model.layers.78*"]},
    ),
}
# ModelOpt's NVFP4 linear method cannot run its load step on a CPU (it needs an SM100 GPU or the
# Marlin backend): these checkpoints skip SGLang's postprocess_weights here. It only repacks the
# FP4 weight and its scales, which the draft head gives up when it takes the target's bf16 weight.
NO_CPU_LOAD_STEP = {"modelopt_fp4"}


def quant_config_for(model_class, quantization: Optional[str], quantization_config: Optional[dict]):
    """SGLang's quant config for ``model_class`` from a checkpoint's ``quantization_config``: its
    ``get_quant_config`` with the class's ``packed_modules_mapping``, then the class's weight-name
    mapper, as ``_get_quantization_config`` does when SGLang loads a model."""
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


class EmulatedPeerGroup:
    """SGLang's TP group as rank ``rank`` sees it, with the other ranks computed from the full weight.

    ``hidden`` is set by the test before each forward; peers' shards are rows of ``full_weight``.
    No communicator is configured, like a group without custom all-reduce or pynccl.
    """

    def __init__(self, rank: int, world: int, full_weight: torch.Tensor, shard_width: int):
        self.rank_in_group, self.world_size = rank, world
        self.full_weight, self.shard_width = full_weight, shard_width
        self.vocab_size = full_weight.shape[0]
        self.hidden = torch.zeros(1, full_weight.shape[1])
        self.logit_scale: Optional[float] = None
        self.cpu_group = None
        self.ca_comm = self.pynccl_comm = self.pymscclpp_comm = None
        self.qr_comm = self.torch_symm_mem_comm = self.pcie_ipc_comm = None
        self.calls: list[str] = []

    def shard_logits(self, rank: int) -> torch.Tensor:
        return shard_logits(
            self.hidden, self.full_weight, rank, self.shard_width, logit_scale=self.logit_scale
        )

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Peers' shards of ``hidden``; zeros for a gather of other rows (the opt-in's prebuild)."""
        self.calls.append("all_gather")
        forward = self.hidden.shape[0] == tensor.shape[0]
        parts = [
            (
                tensor
                if r == self.rank_in_group
                else self.shard_logits(r) if forward else torch.zeros_like(tensor)
            )
            for r in range(self.world_size)
        ]
        return torch.cat(parts, dim=dim)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        total = tensor.clone()
        for r in range(self.world_size):
            if r != self.rank_in_group:
                peer = self.shard_logits(r)
                total += draft_argmax_partials(
                    peer, tp_rank=r, tp_size=self.world_size, vocab_size=self.vocab_size
                )
        return total

    def is_symmetric_memory_enabled(self) -> bool:
        return False

    def _can_use_flashinfer_allreduce(self, tensor) -> bool:
        return False


@dataclass
class DraftHead:
    """One deployment: the draft model (its ``processor`` and ``lm_head``), the target model, the
    EAGLE v2 draft worker that joined them, and the emulated TP group."""

    processor: object
    lm_head: object
    group: EmulatedPeerGroup
    vocab_size: int
    model: object  # the NextN draft model
    target: object  # the target model
    worker: object  # SGLang's EagleDraftWorker (built without a model runner)

    def metadata(self, mode: str, select_index=None, **fields):
        from sglang.srt.layers.logits_processor import LogitsMetadata
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        forward_mode = {
            "decode": ForwardMode.DECODE,
            "idle": ForwardMode.IDLE,
            "extend": ForwardMode.EXTEND,
            "draft_extend_v2": ForwardMode.DRAFT_EXTEND_V2,
        }[mode]
        return LogitsMetadata(
            forward_mode=forward_mode, draft_extend_select_index=select_index, **fields
        )

    def forward(self, hidden: torch.Tensor, mode: str = "decode", select_index=None, **fields):
        """SGLang's ``LogitsProcessor.forward`` on ``hidden`` (rows of the whole batch)."""
        self.group.hidden = hidden if select_index is None else hidden[select_index]
        input_ids = torch.zeros(hidden.shape[0], dtype=torch.int64)
        metadata = self.metadata(mode, select_index, **fields)
        return self.processor.forward(input_ids, hidden, self.lm_head, metadata)

    def gathered_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """SGLang's gathered fp32 logits for ``hidden``, every rank's shard concatenated and sliced."""
        group = self.group
        return reference_logits(
            hidden,
            group.full_weight,
            group.world_size,
            group.shard_width,
            logit_scale=group.logit_scale,
        )


def _model(class_path: str, *, embed_tokens, lm_head, logits_processor):
    """A real SGLang model class instance holding only its embedding, head and processor (the
    layers are not built: the LM-head path reads none of them)."""
    model = object.__new__(pkgutil.resolve_name(class_path))
    torch.nn.Module.__init__(model)
    model.model = torch.nn.Module()
    model.model.embed_tokens = embed_tokens
    model.lm_head = lm_head
    model.logits_processor = logits_processor
    return model


@pytest.fixture
def draft_head():
    """``draft_head(vocab_size=..., dtype=..., checkpoint=..., **options)``: rank 1 of an emulated
    TP 2 MTP deployment, built from ``CHECKPOINTS[checkpoint]`` (default ``"unquantized"``).

    Each call installs its own group as SGLang's TP group: the deployment built last is the one
    whose group SGLang's collectives reach.

    Options: ``logit_scale``, ``final_logit_softcapping``, ``skip_all_gather``, ``tp_size``,
    ``enable_dp_lm_head``, ``attn_dp_size``, ``enable_tp_lm_head_all_to_all``, ``added_vocab``.
    """
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import PretrainedConfig

    stack = contextlib.ExitStack()
    override = get_context().override_server_args()
    override.install()
    stack.callback(override.restore)

    def build(
        vocab_size=1001,
        dtype=torch.bfloat16,
        *,
        checkpoint="unquantized",
        seed=0,
        tp_size=2,
        logit_scale=None,
        final_logit_softcapping=None,
        skip_all_gather=False,
        enable_dp_lm_head=False,
        attn_dp_size=1,
        enable_tp_lm_head_all_to_all=False,
        added_vocab=0,
    ) -> DraftHead:
        model_name, quantization, quantization_config = CHECKPOINTS[checkpoint]
        target_class, draft_class, num_layers = MODELS[model_name]
        generator = torch.Generator().manual_seed(seed)
        full_weight = torch.randn(vocab_size, HIDDEN, generator=generator).to(dtype)
        placeholder = SimpleNamespace(world_size=tp_size, rank_in_group=min(1, tp_size - 1))
        attn_tp_size = tp_size // attn_dp_size
        attn_placeholder = SimpleNamespace(
            world_size=attn_tp_size, rank_in_group=placeholder.rank_in_group % attn_tp_size
        )
        parallel = dict(
            tp_size=tp_size,
            tp_rank=placeholder.rank_in_group,
            moe_tp_size=tp_size,
            attn_tp_size=attn_tp_size,
            attn_tp_rank=attn_placeholder.rank_in_group,
            attn_dp_size=attn_dp_size,
            enable_dp_lm_head=enable_dp_lm_head,
            enable_tp_lm_head_all_to_all=enable_tp_lm_head_all_to_all,
            tp_group=placeholder,
            attn_tp_group=attn_placeholder,
        )
        stack.enter_context(get_parallel().override(**parallel))
        config = PretrainedConfig(
            vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=num_layers
        )
        if final_logit_softcapping is not None:
            config.final_logit_softcapping = final_logit_softcapping

        def head(model_class: str, prefix: str):
            # The heads of DeepseekV2ForCausalLM and DeepseekV3ForCausalLMNextN, in the dtype SGLang's
            # loader sets as the default while it builds a model.
            quant_config = quant_config_for(
                pkgutil.resolve_name(model_class), quantization, quantization_config
            )
            with set_default_torch_dtype(dtype):
                return ParallelLMHead(
                    vocab_size + added_vocab,
                    HIDDEN,
                    org_num_embeddings=vocab_size,
                    quant_config=quant_config,
                    prefix=prefix,
                    use_attn_tp_group=get_parallel().enable_dp_lm_head,
                )

        def embedding():
            with set_default_torch_dtype(dtype):
                return VocabParallelEmbedding(vocab_size, HIDDEN)

        target_head = head(target_class, "lm_head")
        loaded = full_weight.to(target_head.weight.dtype)
        target_head.weight.weight_loader(target_head.weight, loaded)
        group = EmulatedPeerGroup(
            placeholder.rank_in_group,
            tp_size,
            full_weight,
            target_head.num_embeddings_per_partition,
        )
        group.logit_scale = logit_scale
        attn_group = group if attn_dp_size == 1 else attn_placeholder
        stack.enter_context(get_parallel().override(tp_group=group, attn_tp_group=attn_group))
        target = _model(
            target_class,
            embed_tokens=embedding(),
            lm_head=target_head,
            logits_processor=LogitsProcessor(config),
        )
        processor = LogitsProcessor(
            config, skip_all_gather=skip_all_gather, logit_scale=logit_scale
        )
        draft = _model(
            draft_class,
            embed_tokens=embedding(),
            lm_head=head(draft_class, "model.shared_head.head"),
            logits_processor=processor,
        )
        if checkpoint not in NO_CPU_LOAD_STEP:
            for model in (target, draft):
                DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))

        # The draft worker takes the target's embedding and head weight, as at start-up.
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
        # set_embed_and_head ends with a device barrier, which has nothing to wait for on a CPU.
        with mock.patch.object(torch.cuda, "synchronize"):
            worker.init_lm_head()
        return DraftHead(
            processor, draft.lm_head, group, vocab_size, model=draft, target=target, worker=worker
        )

    with stack:
        yield build
