"""Real SGLang DSA attention backends off the GPU, built by SGLang's own constructors.

What a server process does before it captures its graphs, minus the model and the GPU:

- :func:`serving` publishes a ``ServerArgs`` to SGLang's runtime context, as a server process does
  (``override_server_args``, SGLang's own test entry: the launch's fields, resolved by SGLang). The
  default is the spec's H200 launch: EAGLE 4/1/5, fp8_e4m3 KV cache, FlashMLA-KV prefill and decode
  (what SGLang resolves for an fp8 KV cache on SM90), 48 running requests (SGLang's cap in spec
  mode).
- :func:`model_runner` is a stand-in for ``ModelRunner`` holding what the DSA backend constructor
  reads (the model config holds a real ``transformers`` ``GlmMoeDsaConfig``: GLM-5's DSA shape).
- :func:`target_backend`, :func:`draft_backends` build the backends the way SGLang does: the target
  through SGLang's attention registry, the draft-extend and multi-step backends through SGLang's
  ``DraftBackendFactory``.
- :func:`cuda_stand_ins` replaces, for the test, the CUDA-only pieces these backends call
  (DeepGEMM's paged-MQA schedule, the top-k v2 plan, FlashMLA's tile metadata, the device's
  capability) with deterministic torch functions, and tells ``dsa_backend`` it runs on CUDA, so that
  SGLang's own CUDA code paths (its drop decision, its fused replay metadata) run here.
- :func:`capture` and :func:`replay` call the backends' real graph entry points with the forward
  batches SGLang's graph runners hand them; :func:`graph_state_bytes` sums what a backend's CUDA-graph
  state holds.

Works on the CPU (tests: the metadata kernels through Triton's interpreter) and on the meta device
(memory accounting at full width, nothing allocated).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

GLM5_CONTEXT = 1 << 20  # the spec's 1M-token context
LAUNCHES = {"4/1/5": (4, 1, 5), "5/1/6": (5, 1, 6)}  # EAGLE steps / topk / draft tokens
SMS = 132  # H200


@contextlib.contextmanager
def serving(launch: str | tuple[int, int, int] | None = "4/1/5", **server_args):
    """SGLang's runtime context as a server process of ``launch`` publishes it: a key of
    :data:`LAUNCHES`, (steps, topk, draft tokens), or None for no speculative decoding."""
    from sglang.srt.runtime_context import get_context, get_parallel

    fields = dict(
        max_running_requests=48,  # SGLang's cap in spec mode
        kv_cache_dtype="fp8_e4m3",
        dsa_prefill_backend="flashmla_kv",
        dsa_decode_backend="flashmla_kv",
    )
    if launch is not None:
        steps, topk, tokens = LAUNCHES[launch] if isinstance(launch, str) else launch
        fields.update(
            speculative_algorithm="EAGLE",
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens,
        )
    fields.update(server_args)
    with get_context().override_server_args(**fields) as published:
        with get_parallel().override(attn_dcp_rank=0):
            yield published


def glm5_config(**overrides):
    """GLM-5's DSA config (``transformers``' defaults for ``GlmMoeDsaConfig``)."""
    from transformers import GlmMoeDsaConfig

    config = GlmMoeDsaConfig(**overrides)
    config.architectures = ["GlmMoeDsaForCausalLM"]
    return config


def model_runner(
    *,
    context_len: int,
    is_draft: bool = False,
    page_size: int = 64,
    req_pool_size: int = 8,
    device: str = "cpu",
    hf_config=None,
    hisparse_coordinator=None,
    req_to_token: torch.Tensor | None = None,
):
    """What ``DeepseekSparseAttnBackend.__init__`` reads from a ``ModelRunner``.

    ``req_to_token`` is ``[req_pool_size, context_len + 4 + draft tokens]`` int32 (SGLang's pool adds 4
    columns, and the draft tokens a round may run past the context); pass one to share it between the
    target and the draft runner, as SGLang's draft worker does.
    """
    from sglang.srt.runtime_context import get_schedule, get_spec

    hf = glm5_config() if hf_config is None else hf_config
    if req_to_token is None:
        width = context_len + 4 + (get_spec().speculative_num_draft_tokens or 0)
        req_to_token = torch.zeros(req_pool_size, width, dtype=torch.int32, device=device)
    return SimpleNamespace(
        device=device,
        page_size=page_size,
        is_draft_worker=is_draft,
        max_running_requests=get_schedule().max_running_requests or req_to_token.shape[0],
        kv_cache_dtype=torch.float8_e4m3fn,
        model_config=SimpleNamespace(
            hf_config=hf,
            context_len=context_len,
            num_attention_heads=hf.num_attention_heads,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            kv_lora_rank=hf.kv_lora_rank,
        ),
        token_to_kv_pool=SimpleNamespace(
            dsa_kv_cache_store_fp8=True,
            kv_cache_dim=656,
            dtype=torch.float8_e4m3fn,
            index_page_size=page_size,
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=req_to_token.shape[0]),
        hisparse_coordinator=hisparse_coordinator,
        draft_attention_backend="dsa",
    )


def target_backend(runner):
    """The target model's attention backend, from SGLang's attention registry (``dsa``)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS["dsa"](runner)


def draft_backends(draft_runner, *, seeded: bool = True):
    """(draft extend backend, multi-step draft decode backend), from SGLang's ``DraftBackendFactory``.

    ``seeded``: the draft's top-k comes from draft extend (GLM-5 with index share and topk 1)."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    spec = get_spec()
    factory = DraftBackendFactory(
        draft_runner,
        spec.speculative_eagle_topk,
        spec.speculative_num_steps,
        seed_dsa_topk_from_draft_extend=seeded,
    )
    _, extend = factory._create_dsa_prefill_backend()
    _, multi = factory._create_dsa_decode_backend()
    return extend, multi


def _schedule_stand_in(context_lens, block_size, num_sms):
    """DeepGEMM's paged-MQA schedule stand-in: ``[num_sms + 1, 2]`` int32 from the lengths."""
    out = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)
    out[0, 0] = context_lens.sum()
    out[0, 1] = context_lens.numel()
    return out


def _topk_plan_stand_in(lengths):
    """The top-k v2 plan stand-in: a copy of the lengths it is planned from."""
    return lengths.to(torch.int32).clone()


def _flashmla_stand_in(self, cache_seqlens, seq_len_q):
    """FlashMLA's tile metadata stand-in: ``num_splits`` ``[len + 1]`` and ``[8, 8]`` tile data."""
    from sglang.srt.layers.attention.dsa_backend import DSAFlashMLAMetadata

    lengths = cache_seqlens.to(torch.int32)
    tiles = torch.zeros(8, 8, dtype=torch.int32, device=lengths.device)
    tiles[0, 0] = lengths.sum()
    splits = torch.cumsum(lengths // 64 + seq_len_q, 0, dtype=torch.int32)
    return DSAFlashMLAMetadata(
        flashmla_metadata=tiles, num_splits=torch.nn.functional.pad(splits, (1, 0))
    )


def set_platform(monkeypatch, *, cuda: bool, hip: bool) -> None:
    """What SGLang's metadata manager and the plugin's hook sites see as the platform."""
    import importlib

    for name in (
        "sglang.srt.layers.attention.dsa.dsa_metadata_manager",
        "sglang_dsa_mtp.integration.dsa_metadata_selection",
        "sglang_dsa_mtp.integration.dsa_mtp_draft_metadata",
        "sglang_dsa_mtp.integration.eagle_draft_argmax",
        "sglang_dsa_mtp.integration.dsa_verify_mask",
        "sglang_dsa_mtp.integration.dsa_graph_page_tables",
    ):
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "is_cuda", lambda: cuda)
        monkeypatch.setattr(module, "is_hip", lambda: hip)


def cuda_stand_ins(monkeypatch) -> None:
    """SGLang's CUDA-only pieces replaced by deterministic torch stand-ins for one test."""
    import sglang.kernels.ops.attention.dsv4.topk as topk_v2
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    monkeypatch.setattr(dsa_backend, "is_cuda", lambda: True)
    monkeypatch.setattr(dsa_backend, "resolve_num_sms", lambda: SMS)
    monkeypatch.setattr(
        dsa_backend, "resolve_paged_mqa_logits_metadata_fn", lambda: _schedule_stand_in
    )
    monkeypatch.setattr(topk_v2, "plan_topk_v2", _topk_plan_stand_in)
    monkeypatch.setattr(
        dsa_backend.DeepseekSparseAttnBackend, "_compute_flashmla_metadata", _flashmla_stand_in
    )


def graph_batch(bs: int, mode, *, seq_lens, req_pool_indices, device="cpu"):
    """The forward batch a graph runner hands its attention backend for ``bs`` requests."""
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    return SimpleNamespace(
        batch_size=bs,
        forward_mode=mode,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        seq_lens_sum=None,  # DSA opts out of the host sum (needs_cpu_seq_lens = False)
        req_pool_indices=torch.as_tensor(req_pool_indices, dtype=torch.int64).to(device),
        spec_info=None,
        out_cache_loc=None,
        input_ids=None,
        positions=None,
        encoder_lens=None,
    )


def capture(backend, bs: int, mode, *, fill: int = 1, device="cpu") -> None:
    """What a graph runner's capture does to the backend's metadata for ``bs`` (its seq-len fill)."""
    batch = graph_batch(bs, mode, seq_lens=[fill] * bs, req_pool_indices=[0] * bs, device=device)
    backend.init_forward_metadata_out_graph(batch, in_capture=True)


def replay(backend, mode, seq_lens, req_pool_indices, *, device="cpu") -> None:
    """What a graph replay does to the backend's metadata for these requests."""
    batch = graph_batch(
        len(seq_lens), mode, seq_lens=seq_lens, req_pool_indices=req_pool_indices, device=device
    )
    backend.init_forward_metadata_out_graph(batch)


def _tensors(value, seen: set):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, seen)
    elif hasattr(value, "__dataclass_fields__") and id(value) not in seen:
        seen.add(id(value))
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name), seen)
    elif hasattr(value, "__struct_fields__") and id(value) not in seen:  # msgspec (VerifyMask)
        seen.add(id(value))
        for name in value.__struct_fields__:
            yield from _tensors(getattr(value, name), seen)


def graph_state_bytes(backend) -> int:
    """Bytes of the distinct tensors a DSA backend's CUDA-graph state holds: every captured batch
    size's metadata, the shared buffers, the plugin's verify mask and shared compact table."""
    from sglang_dsa_mtp.integration.dsa_graph_page_tables import SHARED_REAL
    from sglang_dsa_mtp.integration.dsa_verify_mask import MASK

    roots = [backend.decode_cuda_graph_metadata, vars(backend).get(SHARED_REAL)]
    roots.append(vars(backend).get(MASK))
    bases = {}
    seen: set = set()
    for root in roots:
        for tensor in _tensors(root, seen):
            base = tensor if tensor._base is None else tensor._base
            bases[id(base)] = base
    return sum(base.untyped_storage().nbytes() for base in bases.values())


def read_buffers(metadata) -> dict[str, torch.Tensor]:
    """What the kernels reading one batch size's graph metadata can see: every tensor field whole
    (FlashMLA's too), and of the two page tables each row's live columns only. Past a row's live
    columns a replay leaves whatever an earlier replay wrote (SGLang's contract: readers stop at the
    row's length), so those cells are not compared."""
    out = {}
    for name in metadata.__dataclass_fields__:
        value = getattr(metadata, name)
        if name in ("page_table_1", "real_page_table") or value is None:
            continue
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, torch.Tensor):
            out[name] = value.clone()
        elif hasattr(value, "num_splits"):
            out[name + ".num_splits"] = value.num_splits.clone()
            out[name + ".flashmla_metadata"] = value.flashmla_metadata.clone()
    lengths = metadata.cache_seqlens_int32
    for name, step in (("page_table_1", 1), ("real_page_table", metadata.page_size)):
        table = getattr(metadata, name)
        if table is None:
            continue
        rows = table.shape[0]
        row_lengths = lengths.repeat_interleave(rows // lengths.numel())
        live = (
            torch.arange(table.shape[1], device=table.device)[None, :] * step < row_lengths[:, None]
        )
        out[name + " (live)"] = table[live].clone()
    return out
