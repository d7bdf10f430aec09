"""SGLang 0.5.23's DSA attention backends on the CPU, built, captured and replayed by SGLang's own code.

:class:`CpuDsaServer` publishes what SGLang's constructors read (server args for EAGLE with top-k 1,
the parallel bundle of one rank, a model runner with a DSA model config, KV pool and
``req_to_token``), then builds ``DeepseekSparseAttnBackend`` (target, draft extend) and
``DeepseekSparseAttnMultiStepBackend`` (MTP draft decode) through their real constructors, sizes their
graph state with ``init_cuda_graph_state``, captures batch sizes and replays them through
``init_forward_metadata_out_graph``, as SGLang's graph runners call it.

Only what cannot run on a CPU is replaced, by deterministic stand-ins that depend on every input
value: the device capability query, DeepGEMM's paged-MQA schedule (``resolve_num_sms``,
``resolve_paged_mqa_logits_metadata_fn``), SGLang's JIT top-k v2 plan (``plan_topk_v2``), and
SGLang's three replay-metadata kernels as its selection stores them (the same files, loaded with their
``assert tensor.is_cuda`` compiled out, running through Triton's interpreter). ``is_cuda()`` reads True
inside ``dsa_backend``, so that the replay takes the fused-kernel path and refreshes the schedule, as
on a GPU. Every stand-in call is counted in :attr:`CpuDsaServer.calls`.
"""

from __future__ import annotations

import collections
import contextlib
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_dsa_mtp.test.reference import metadata_module

WIDTH = 300  # req_to_token width: not a multiple of 64 nor of 128
TOPK = 200
POOL = 8  # request slots; slot 0 stays all zeros, as SGLang's pool keeps it
NUM_SMS = 8  # the stand-in schedule's SM count


class CpuDsaServer:
    """SGLang's DSA backends on the CPU; ``monkeypatch`` undoes every change after the test."""

    def __init__(
        self,
        monkeypatch,
        *,
        num_steps: int = 4,
        draft_tokens: int = 5,
        page_size: int = 64,
        kpool: int = 1,
        decode_impl: str = "fa3",
        seed: int = 0,
    ):
        import sglang.kernels.ops.attention.dsv4.topk as topk_module
        import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager
        import sglang.srt.layers.attention.dsa_backend as dsa_backend
        from sglang.srt.runtime_context import get_context, get_parallel

        self.num_steps, self.draft_tokens = num_steps, draft_tokens
        self.calls: collections.Counter = collections.Counter()
        self._stack = contextlib.ExitStack()
        override = get_context().override_server_args(
            speculative_algorithm="EAGLE",
            speculative_eagle_topk=1,
            speculative_num_steps=num_steps,
            speculative_num_draft_tokens=draft_tokens,
            dsa_decode_backend=decode_impl,
            dsa_prefill_backend="flashmla_sparse",
        )
        override.install()
        self._stack.callback(override.restore)
        self._stack.enter_context(
            get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
        )
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        monkeypatch.setattr(dsa_backend, "is_cuda", lambda: True)
        monkeypatch.setattr(dsa_backend, "resolve_num_sms", lambda: NUM_SMS)
        monkeypatch.setattr(
            dsa_backend, "resolve_paged_mqa_logits_metadata_fn", lambda: self._schedule
        )
        monkeypatch.setattr(topk_module, "plan_topk_v2", self._topk_plan)
        sglang_kernels = metadata_module(strip_asserts=True)
        for name in (
            "fused_dsa_decode_metadata",
            "fused_dsa_target_verify_metadata",
            "fused_dsa_draft_extend_metadata",
        ):
            monkeypatch.setattr(manager, name, getattr(sglang_kernels, name))
        gen = torch.Generator().manual_seed(seed)
        req_to_token = torch.randint(0, 1 << 30, (POOL, WIDTH), dtype=torch.int32, generator=gen)
        req_to_token[0] = 0
        hf_config = SimpleNamespace(
            architectures=["GlmMoeDsaForCausalLM"], index_topk=TOPK, index_kpool=kpool
        )
        self.runner = SimpleNamespace(
            device="cpu",
            page_size=page_size * kpool,
            is_draft_worker=False,
            model_config=SimpleNamespace(
                hf_config=hf_config,
                context_len=WIDTH - 4 - draft_tokens,
                num_attention_heads=64,
                qk_nope_head_dim=128,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
            ),
            token_to_kv_pool=SimpleNamespace(
                dsa_kv_cache_store_fp8=False, kv_cache_dim=576, dtype=torch.bfloat16
            ),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=POOL),
            hisparse_coordinator=None,
            kv_cache_dtype=torch.bfloat16,
        )

    def close(self) -> None:
        self._stack.close()

    # --- CUDA-only leaves -------------------------------------------------------------------------

    def _schedule(self, ctx_lens: torch.Tensor, page: int, num_sms: int) -> torch.Tensor:
        """Stand-in for DeepGEMM's ``get_paged_mqa_logits_metadata``: [num_sms + 1, 2] int32."""
        self.calls["schedule"] += 1
        lens = ctx_lens.reshape(-1).to(torch.int64)
        rows = torch.arange(num_sms + 1, dtype=torch.int64)
        picked = lens[rows % lens.numel()] if lens.numel() else torch.zeros_like(rows)
        return torch.stack([(lens.sum() * (rows + 1) + page) % (1 << 31), picked], 1).int()

    def _topk_plan(self, seq_lens: torch.Tensor, static_threshold=-1, *, out=None) -> torch.Tensor:
        """Stand-in for SGLang's JIT ``plan_topk_v2``: [bs + 1, 4] int32."""
        self.calls["topk_plan"] += 1
        lens = seq_lens.reshape(-1).to(torch.int64)
        rows = torch.arange(lens.numel(), dtype=torch.int64)
        body = torch.stack([lens, rows, lens % 7, (lens > 64).long()], 1)
        tail = torch.tensor([[int(lens.sum()), lens.numel(), 0, 0]])
        plan = torch.cat([body, tail]).int()
        return plan if out is None else out.copy_(plan)

    # --- backends ---------------------------------------------------------------------------------

    def target(self, max_bs: int):
        """The target model's backend, graph state sized for target verify."""
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

        backend = DeepseekSparseAttnBackend(self.runner)
        backend.init_cuda_graph_state(max_bs, max_bs * self.draft_tokens)
        return backend

    def draft_extend(self, max_bs: int):
        """The draft model's draft-extend backend (``DraftBackendFactory``: a plain DSA backend)."""
        return self.target(max_bs)

    def multi_step(self, max_bs: int, *, seeded: bool):
        """The draft model's MTP draft-decode backend: ``num_steps - 1`` step backends."""
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnMultiStepBackend

        multi = DeepseekSparseAttnMultiStepBackend(
            self.runner, 1, self.num_steps, seed_dsa_topk_from_draft_extend=seeded
        )
        multi.init_cuda_graph_state(max_bs, max_bs)
        return multi

    # --- capture and replay, as the graph runners call them ---------------------------------------

    def capture(self, backend, mode, batch_sizes) -> None:
        """Capture ``batch_sizes`` (largest first, as SGLang does) from the runner's input buffers:
        lengths filled with 1, every slot 0."""
        max_bs = max(batch_sizes)
        seq_lens = torch.ones(max_bs, dtype=torch.int64)
        req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        for bs in sorted(batch_sizes, reverse=True):
            batch = self.batch(mode, seq_lens[:bs], req_pool_indices[:bs])
            backend.init_forward_metadata_out_graph(batch, in_capture=True)

    def replay(self, backend, mode, lengths, slots, *, bs: Optional[int] = None) -> None:
        """One replay's metadata for requests of ``lengths`` in ``slots``, padded to the captured
        ``bs`` (length 1, slot 0) as the graph runners pad."""
        bs = len(lengths) if bs is None else bs
        pad = bs - len(lengths)
        seq_lens = torch.tensor(list(lengths) + [1] * pad, dtype=torch.int64)
        req_pool_indices = torch.tensor(list(slots) + [0] * pad, dtype=torch.int64)
        backend.init_forward_metadata_out_graph(self.batch(mode, seq_lens, req_pool_indices))

    @staticmethod
    def batch(mode, seq_lens, req_pool_indices) -> SimpleNamespace:
        return SimpleNamespace(
            batch_size=seq_lens.shape[0],
            forward_mode=mode,
            seq_lens=seq_lens,
            req_pool_indices=req_pool_indices,
            seq_lens_cpu=seq_lens.cpu(),
            seq_lens_sum=int(seq_lens.sum()),
            spec_info=None,
            input_ids=None,
            positions=None,
            out_cache_loc=None,
        )


def metadata_tensors(metadata) -> dict[str, torch.Tensor]:
    """Every tensor of a captured ``DSAMetadata`` (its dataclass fields), by field name."""
    import dataclasses

    return {
        field.name: getattr(metadata, field.name)
        for field in dataclasses.fields(metadata)
        if isinstance(getattr(metadata, field.name), torch.Tensor)
    }


def poison(metadata, value: int) -> None:
    """Fill every int32 buffer of a captured ``DSAMetadata`` with ``value`` (the schedule, plans and
    lengths included): what a replay leaves untouched keeps it."""
    for tensor in metadata_tensors(metadata).values():
        if tensor.dtype == torch.int32:
            tensor.fill_(value)
