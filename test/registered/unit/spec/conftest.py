"""Fixtures for the greedy-draft argmax exchange on SGLang's real classes, in one CPU process.

``draft_head(...)`` builds an MTP deployment's LM heads the way SGLang builds them
(:mod:`support.deployment`: a checkpoint's quant config, the target's and the NextN
draft's ``ParallelLMHead``, the load step, the draft worker's ``init_lm_head`` sharing the target's
head weight), as TP rank 1 of 2: SGLang's runtime config is published (``override_server_args``)
and the parallel context names an :class:`EmulatedPeerGroup` as the TP group. The target head loads
its shard of a full weight through its ``weight_loader``; the draft model's processor is SGLang's
``LogitsProcessor``.

The group plays rank 0 with SGLang's own code: a ``ParallelLMHead`` built as rank 0 loads its shard
of the full weight, and the processor's ``_compute_lm_head`` (then its ``logit_scale``) gives rank
0's shard logits. Its ``all_gather`` puts them before ours (SGLang's gather) and its ``all_reduce``
adds rank 0's exchange buffer of them (the plugin's exchange), so both paths see a whole vocabulary.
The reference they are compared with, ``DraftHead.gathered_logits``, is computed apart from both,
from the full weight (``deployment.reference_logits``). SGLang is imported inside the fixtures.

For the route tests in SGLang's real TP group, which spawn SGLang in worker processes on the GPU:
``sglang_runtime`` skips a test, with the reason, where those workers cannot import SGLang, and
``tp_gpus`` (the visible GPU count) also below two GPUs.
"""

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import draft_argmax_partials
from support import deployment
from support.deployment import reference_logits
from support.sglang_import import sglang_runtime_missing

HIDDEN = 64


class EmulatedPeerGroup:
    """SGLang's TP group as rank ``rank`` sees it, the other ranks computed by SGLang's LM-head path.

    ``hidden`` is set by the test before each forward; ``processor`` (the draft model's) and
    ``peer_heads`` (each other rank's ``ParallelLMHead``, its shard loaded) are set by the fixture.
    No communicator is configured, like a group without custom all-reduce or pynccl.
    """

    def __init__(self, rank: int, world: int, full_weight: torch.Tensor, shard_width: int):
        self.rank_in_group, self.world_size = rank, world
        self.full_weight, self.shard_width = full_weight, shard_width
        self.vocab_size = full_weight.shape[0]
        self.hidden = torch.zeros(1, full_weight.shape[1])
        self.logit_scale: Optional[float] = None
        self.processor = None
        self.peer_heads: dict = {}
        self.cpu_group = None
        self.ca_comm = self.pynccl_comm = self.pymscclpp_comm = None
        self.qr_comm = self.torch_symm_mem_comm = self.pcie_ipc_comm = None
        self.calls: list[str] = []

    def shard_logits(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard logits of ``hidden`` as SGLang's ``_get_logits`` computes them
        before its gather: the processor's ``_compute_lm_head``, then its ``logit_scale``."""
        logits = self.processor._compute_lm_head(self.hidden, self.peer_heads[rank], None)
        if self.processor.logit_scale is not None:
            logits.mul_(self.processor.logit_scale)
        return logits

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

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor``: what this rank computed from the same logits (SGLang's
        sampled verify broadcasts rank 0's outcome)."""
        self.calls.append("broadcast")
        return tensor

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
        """The reference for SGLang's gathered fp32 logits of ``hidden``: every rank's shard of the
        full weight multiplied out by ``deployment.reference_logits``, concatenated and sliced."""
        group = self.group
        return reference_logits(
            hidden,
            group.full_weight,
            group.world_size,
            group.shard_width,
            logit_scale=group.logit_scale,
        )


@pytest.fixture
def draft_head():
    """``draft_head(vocab_size=..., dtype=..., checkpoint=..., **options)``: rank 1 of an emulated
    TP 2 MTP deployment of ``deployment.CHECKPOINTS[checkpoint]`` (default ``"unquantized"``).

    Each call installs its own group as SGLang's TP group: the deployment built last is the one
    whose group SGLang's collectives reach.

    Options: ``logit_scale``, ``final_logit_softcapping``, ``skip_all_gather``, ``tp_size``,
    ``enable_dp_lm_head``, ``attn_dp_size``, ``enable_tp_lm_head_all_to_all``, ``added_vocab``.
    """
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_context, get_parallel
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
        _, _, num_layers = deployment.model_classes(checkpoint)
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
        target_head, draft_head = deployment.lm_heads(
            checkpoint,
            vocab_size,
            HIDDEN,
            dtype=dtype,
            added_vocab=added_vocab,
            use_attn_tp_group=get_parallel().enable_dp_lm_head,
        )
        target_head.weight.weight_loader(
            target_head.weight, full_weight.to(target_head.weight.dtype)
        )
        group = EmulatedPeerGroup(
            placeholder.rank_in_group,
            tp_size,
            full_weight,
            target_head.num_embeddings_per_partition,
        )
        group.logit_scale = logit_scale
        for peer in range(tp_size):
            if peer == group.rank_in_group:
                continue
            peer_group = SimpleNamespace(world_size=tp_size, rank_in_group=peer)
            with get_parallel().override(tp_rank=peer, tp_group=peer_group):
                head = ParallelLMHead(vocab_size, HIDDEN, params_dtype=dtype)
            head.weight.weight_loader(head.weight, full_weight)
            group.peer_heads[peer] = head
        attn_group = group if attn_dp_size == 1 else attn_placeholder
        stack.enter_context(get_parallel().override(tp_group=group, attn_tp_group=attn_group))
        config = PretrainedConfig(
            vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=num_layers
        )
        if final_logit_softcapping is not None:
            config.final_logit_softcapping = final_logit_softcapping
        processor = LogitsProcessor(
            config, skip_all_gather=skip_all_gather, logit_scale=logit_scale
        )
        group.processor = processor
        target, draft, worker = deployment.share_target_head(
            checkpoint,
            target_head,
            draft_head,
            dtype=dtype,
            target_processor=LogitsProcessor(config),
            draft_processor=processor,
        )
        return DraftHead(
            processor, draft.lm_head, group, vocab_size, model=draft, target=target, worker=worker
        )

    with stack:
        yield build


@dataclass
class TargetHead:
    """The target model of a ``draft_head`` deployment, for the target-verify exchange: its
    ``processor`` (the one the EAGLE worker opts in, computing the group's peer shards too) and
    ``stock``, a second SGLang ``LogitsProcessor`` of the same config that never opts in; both run
    the target's ``lm_head``."""

    deployment: DraftHead
    processor: object
    stock: object
    lm_head: object
    model: object

    @property
    def group(self) -> EmulatedPeerGroup:
        return self.deployment.group

    @property
    def vocab_size(self) -> int:
        return self.deployment.vocab_size

    def forward(self, processor, hidden: torch.Tensor, logits_buffer=None):
        """SGLang's target-verify ``LogitsProcessor.forward`` of ``processor`` on ``hidden`` (the
        group's peers compute their shards of the same rows)."""
        from support.deployment import logits_forward

        self.group.hidden = hidden
        return logits_forward(
            processor, self.lm_head, hidden, mode="target_verify", logits_buffer=logits_buffer
        )


@pytest.fixture
def target_head(draft_head):
    """``target_head(logit_scale=None, **options)``: the target model of ``draft_head(**options)``
    (its processor without a logit scale, as the DeepSeek and GLM targets build it; with
    ``logit_scale`` both processors get one), in an EAGLE 4/1/5 launch of up to 48 requests."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.runtime_context import get_schedule, get_spec

    def build(logit_scale=None, **options) -> TargetHead:
        head = draft_head(**options)
        model = head.target
        config = model.logits_processor.config
        if logit_scale is not None:
            model.logits_processor = LogitsProcessor(config, logit_scale=logit_scale)
            head.group.logit_scale = logit_scale
        head.group.processor = model.logits_processor
        stock = LogitsProcessor(config, logit_scale=logit_scale)
        return TargetHead(head, model.logits_processor, stock, model.lm_head, model)

    eagle = dict(
        speculative_algorithm="EAGLE",
        speculative_num_steps=4,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=5,
    )
    with get_spec().override(**eagle), get_schedule().override(max_running_requests=48):
        yield build


def _skip_without_sglang_runtime() -> None:
    missing = sglang_runtime_missing()
    if missing:
        pytest.skip(f"{missing}: source test/gpu_sglang_env.sh first")


@pytest.fixture
def sglang_runtime() -> None:
    """Skips the test where its worker processes cannot import SGLang (``source
    test/gpu_sglang_env.sh`` provides SGLang's dependencies)."""
    _skip_without_sglang_runtime()


@pytest.fixture
def tp_gpus() -> int:
    """The visible CUDA GPUs, the size of a real TP group through SGLang; skips the test below two
    GPUs, then as ``sglang_runtime`` does."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"needs at least 2 CUDA GPUs for a real TP group, found {world}")
    _skip_without_sglang_runtime()
    return world
