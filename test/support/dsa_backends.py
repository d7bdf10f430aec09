"""SGLang 0.5.23's DSA attention backends, built, captured and replayed by SGLang's own code, off a
server: what a server process does before and while it replays its graphs, minus the model.

- :func:`serving` publishes a ``ServerArgs`` to SGLang's runtime context, as a server process does
  (``override_server_args``, SGLang's own test entry; the launch's fields resolved by SGLang). The
  default is the spec's H200 launch: EAGLE 4/1/5, fp8_e4m3 KV cache, FlashMLA-KV prefill and decode
  (what SGLang resolves for an fp8 KV cache on SM90), 48 running requests (SGLang's cap in spec mode).
- :func:`model_runner` stands in for ``ModelRunner`` with what the DSA backend constructor reads (a
  real ``transformers`` ``GlmMoeDsaConfig``: GLM-5's DSA shape); :func:`target_backend` and
  :func:`draft_backends` build the backends as SGLang does (the target through its attention
  registry, the draft-extend and multi-step backends through its ``DraftBackendFactory``).
- :class:`StandIns` (installed by :func:`cuda_stand_ins`) replaces only what needs SGLang's native
  or JIT kernels: DeepGEMM's paged-MQA schedule and SM count, SGLang's JIT top-k v2 plan, FlashMLA's
  tile metadata and the loaders of SGLang's JIT metadata copies (each load recorded, in
  ``jit_loads``; the modules they return raise when called: SGLang then copies with torch); off a GPU
  also the device capability and SGLang's three replay-metadata kernels (the same files with their
  ``assert tensor.is_cuda`` compiled out, run by Triton's interpreter). Each is a
  deterministic torch function of every input value, and counts its calls. Off a GPU ``dsa_backend``
  is told it runs on CUDA, so SGLang's CUDA code paths (its drop decision, its fused replay
  metadata) run there too.
- :func:`capture` and :func:`replay` call the backends' graph entry points with the forward batches
  SGLang's graph runners hand them; :func:`read_buffers`, :func:`metadata_tensors`, :func:`poison`
  and :func:`graph_state_bytes` read what a backend's graph state holds.
- :class:`CpuDsaServer` is the above at the CPU tables' small width, for the replay-metadata hook
  sites.

Works on the CPU (the kernels through Triton's interpreter), on the meta device (memory accounting
at full width, nothing allocated) and on a GPU (SGLang's own Triton kernels).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from types import SimpleNamespace
from unittest import mock

import torch

from support.constants import SMALL_WIDTH, SMS
from support.metadata_cases import SMALL_TOPK
from support.real_ops import REAL_LEAVES
from support.reference import metadata_module

LAUNCHES = {"3/1/4": (3, 1, 4), "4/1/5": (4, 1, 5), "5/1/6": (5, 1, 6)}  # steps / topk / tokens
SGLANG_METADATA_KERNELS = (
    "fused_dsa_decode_metadata",
    "fused_dsa_target_verify_metadata",
    "fused_dsa_draft_extend_metadata",
)


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
        with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
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
    fp8_kv_cache: bool = True,
    token_to_kv_pool=None,
):
    """What ``DeepseekSparseAttnBackend.__init__`` reads from a ``ModelRunner``.

    ``req_to_token`` is ``[req_pool_size, context_len + 4 + draft tokens]`` int32 (SGLang's pool adds 4
    columns, and the draft tokens a round may run past the context); pass one to share it between the
    target and the draft runner, as SGLang's draft worker does. ``token_to_kv_pool``: a real KV pool
    (default: what the constructor reads of one, for an fp8 or bf16 cache as ``fp8_kv_cache`` says).
    """
    from sglang.srt.runtime_context import get_schedule, get_spec

    hf = glm5_config() if hf_config is None else hf_config
    if req_to_token is None:
        width = context_len + 4 + (get_spec().speculative_num_draft_tokens or 0)
        req_to_token = torch.zeros(req_pool_size, width, dtype=torch.int32, device=device)
    kv_dtype = torch.float8_e4m3fn if fp8_kv_cache else torch.bfloat16
    return SimpleNamespace(
        device=device,
        page_size=page_size,
        is_draft_worker=is_draft,
        max_running_requests=get_schedule().max_running_requests or req_to_token.shape[0],
        kv_cache_dtype=kv_dtype,
        model_config=SimpleNamespace(
            hf_config=hf,
            context_len=context_len,
            num_attention_heads=hf.num_attention_heads,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            kv_lora_rank=hf.kv_lora_rank,
        ),
        token_to_kv_pool=token_to_kv_pool
        or SimpleNamespace(
            dsa_kv_cache_store_fp8=fp8_kv_cache,
            kv_cache_dim=656 if fp8_kv_cache else 576,
            dtype=kv_dtype,
            index_page_size=page_size,
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=req_to_token.shape[0]),
        hisparse_coordinator=hisparse_coordinator,
        draft_attention_backend="dsa",
    )


# SGLang's switch for its torch paged-MQA logits (DeepGEMM's stand-in in this harness).
TORCH_LOGITS_ENV = "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"


@contextlib.contextmanager
def torch_logits():
    """SGLang's torch paged-MQA logits for the block: ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1`` (with
    it SGLang resolves the SM count from the device, not DeepGEMM), its resolvers re-read before
    and after; the function reading only the pages DeepGEMM's reads (:func:`live_pages`)."""
    import sglang.srt.layers.attention.dsa.utils as dsa_utils
    from sglang.srt.layers.attention.dsv4 import indexer

    resolvers = (dsa_utils.resolve_fp8_paged_mqa_logits_fn, dsa_utils.resolve_num_sms)
    logits = live_pages(indexer.fp8_paged_mqa_logits_torch)
    with mock.patch.dict(os.environ, {TORCH_LOGITS_ENV: "1"}):
        for resolver in resolvers:
            resolver.cache_clear()
        try:
            with mock.patch.object(indexer, "fp8_paged_mqa_logits_torch", logits):
                yield
        finally:
            for resolver in resolvers:
                resolver.cache_clear()


def live_pages(logits_fn):
    """SGLang's torch paged-MQA logits ``logits_fn`` reading a row's pages below its length only,
    as DeepGEMM's kernel does: the page-table entries of the pages a row's length does not reach
    read as page 0. SGLang's torch function gathers every entry of the table, masking the scores
    past the length afterwards; a replay prep leaves those entries as an earlier replay, or the
    capture, left them (its readers stop at the row's length), which can name no page of the pool.
    The scores are SGLang's bit for bit wherever its own gather stays in the pool."""

    def logits(q_fp8, kvcache_fp8, weight, seq_lens, page_table, *args, **kwargs):
        pages = torch.arange(page_table.shape[1], device=page_table.device)
        unread = pages[None, :] * kvcache_fp8.shape[1] >= seq_lens.reshape(-1, 1)
        return logits_fn(
            q_fp8, kvcache_fp8, weight, seq_lens, page_table.masked_fill(unread, 0), *args, **kwargs
        )

    return logits


def sglang_indexer(config, device):
    """SGLang's ``Indexer`` of layer 0, built by its constructor from the transformers DSA
    ``config`` on ``device``, in the runtime context of a server without speculative decoding,
    under SGLang's torch logits (:func:`torch_logits`); its rotary embedding, which
    ``_get_topk_paged`` does not use (SGLang's needs vllm off a GPU), an identity."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    def identity(*args, **kwargs):
        return torch.nn.Identity()

    rope = mock.patch.object(dsa_indexer, "get_rope_wrapper", identity)
    with serving(None), torch_logits(), rope, torch.device(device):
        return dsa_indexer.Indexer(
            hidden_size=config.hidden_size,
            index_n_heads=config.index_n_heads,
            index_head_dim=config.index_head_dim,
            rope_head_dim=config.qk_rope_head_dim,
            index_topk=config.index_topk,
            q_lora_rank=config.q_lora_rank,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=config.rope_parameters["rope_theta"],
            layer_id=0,
            scale_fmt="ue8m0",
            block_size=128,
            is_neox_style=True,
            prefix="model.layers.0.self_attn.indexer",
            config=config,
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


class StandIns:
    """Deterministic torch stand-ins for SGLang's native and JIT leaves, counting their calls."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.jit_loads: list[tuple] = []  # (loader name, its arguments) of each JIT module load

    def jit_module(self, loader: str):
        """A loader of SGLang's JIT metadata copies: records the load; the module's kernels raise
        (they stand aside in this harness, on every device)."""

        def load(*args):
            self.jit_loads.append((loader, args))
            return SimpleNamespace(
                fused_metadata_copy=_no_jit_kernel, fused_metadata_copy_multi=_no_jit_kernel
            )

        return load

    def schedule(self, context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
        """DeepGEMM's ``get_paged_mqa_logits_metadata``: ``[num_sms + 1, 2]`` int32."""
        self.calls["schedule"] += 1
        lens = context_lens.reshape(-1).to(torch.int64)
        rows = torch.arange(num_sms + 1, dtype=torch.int64, device=lens.device)
        picked = lens[rows % lens.numel()] if lens.numel() else torch.zeros_like(rows)
        return torch.stack([(lens.sum() * (rows + 1) + block_kv) % (1 << 31), picked], 1).int()

    def topk_plan(self, seq_lens: torch.Tensor, static_threshold=-1, *, out=None) -> torch.Tensor:
        """SGLang's JIT ``plan_topk_v2``: ``[bs + 1, 4]`` int32."""
        self.calls["topk_plan"] += 1
        lens = seq_lens.reshape(-1).to(torch.int64)
        rows = torch.arange(lens.numel(), dtype=torch.int64, device=lens.device)
        body = torch.stack([lens, rows, lens % 7, (lens > 64).long()], 1)
        tail = torch.zeros(1, 4, dtype=torch.int64, device=lens.device)
        tail[0, 0] = (
            lens.sum()
        )  # device work only: SGLang's replays, and a glue's capture, run here
        tail[0, 1].fill_(lens.numel())
        plan = torch.cat([body, tail]).int()
        return plan if out is None else out.copy_(plan)

    def quiet_print(self, *args, **kwargs) -> None:
        """``print`` in SGLang's DSA modules: the warning of a JIT metadata copy that stands aside is
        counted, anything else printed."""
        if args and "etadata copy kernel" in str(args[0]):
            self.calls["jit metadata copy"] += 1
        else:
            print(*args, **kwargs)

    def flashmla(self, backend, cache_seqlens: torch.Tensor, seq_len_q: int):
        """FlashMLA's tile metadata: ``num_splits`` ``[len + 1]`` and ``[8, 8]`` tile data."""
        from sglang.srt.layers.attention.dsa_backend import DSAFlashMLAMetadata

        self.calls["flashmla"] += 1
        lengths = cache_seqlens.to(torch.int32)
        tiles = torch.zeros(8, 8, dtype=torch.int32, device=lengths.device)
        tiles[0, 0] = lengths.sum()
        splits = torch.cumsum(lengths // 64 + seq_len_q, 0, dtype=torch.int32)
        return DSAFlashMLAMetadata(
            flashmla_metadata=tiles, num_splits=torch.nn.functional.pad(splits, (1, 0))
        )


def cuda_stand_ins(monkeypatch, *, sms: int | None = None, real=()) -> StandIns:
    """SGLang's native and JIT leaves replaced for one test or run, on any device; ``dsa_backend``
    then runs its CUDA paths:

    - DeepGEMM's paged-MQA schedule and SM count (``resolve_paged_mqa_logits_metadata_fn``,
      ``resolve_num_sms``): :meth:`StandIns.schedule`, and ``sms`` (default: the CUDA device's SM
      count, else :data:`SMS`);
    - SGLang's JIT top-k v2 plan (``plan_topk_v2``) and FlashMLA's tile metadata
      (``_compute_flashmla_metadata``): :meth:`StandIns.topk_plan`, :meth:`StandIns.flashmla`;
    - the loaders of SGLang's JIT metadata copies (``fused_metadata_copy_cuda`` /
      ``fused_metadata_copy_multi_cuda`` are built with nvcc on first use): each load is recorded
      (:meth:`StandIns.jit_module`), the copies raise, and SGLang takes its own fallback (torch copies,
      every step backend's indexer plans refreshed); the warning SGLang prints at each such call is
      counted (``calls["jit metadata copy"]``) instead of printed;
    - off a GPU only: the device capability (9, 0), ``dsa_backend.is_cuda``, and SGLang's three
      replay-metadata kernels (its own files with their ``assert tensor.is_cuda`` compiled out, run by
      Triton's interpreter).

    On a GPU, the leaves named in ``real`` (of ``real_ops.REAL_LEAVES``, each made available first:
    ``support.real_ops.real_leaves``) stay SGLang's own: the paged-MQA schedule is its JIT one and
    the SM count the device's (what SGLang's resolvers return under
    ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``, where DeepGEMM is absent), the top-k v2 plan its JIT
    plan, FlashMLA's metadata its ``get_mla_metadata``, the metadata copies its JIT kernels.
    """
    import sglang.kernels.ops.attention.dsa.fused_metadata_copy as metadata_copy
    import sglang.kernels.ops.attention.dsv4.topk as topk_v2
    import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    stand_ins = StandIns()
    on_gpu = torch.cuda.is_available()
    unknown = set(real) - set(REAL_LEAVES)
    if unknown or (real and not on_gpu):
        raise ValueError(f"real: {sorted(real)} (of {REAL_LEAVES}, on a GPU only)")
    if sms is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else SMS
    monkeypatch.setattr(dsa_backend, "resolve_num_sms", lambda: sms)
    schedule = stand_ins.schedule
    if "paged-MQA schedule" in real:
        from sglang.kernels.ops.attention.dsv4.attn import get_paged_mqa_logits_metadata

        schedule = get_paged_mqa_logits_metadata
    monkeypatch.setattr(dsa_backend, "resolve_paged_mqa_logits_metadata_fn", lambda: schedule)
    if "top-k v2 plan" not in real:
        monkeypatch.setattr(topk_v2, "plan_topk_v2", stand_ins.topk_plan)
    if "FlashMLA metadata" not in real:
        monkeypatch.setattr(
            dsa_backend.DeepseekSparseAttnBackend,
            "_compute_flashmla_metadata",
            lambda self, cache_seqlens, seq_len_q: stand_ins.flashmla(
                self, cache_seqlens, seq_len_q
            ),
        )
    if "JIT metadata copies" not in real:
        for name in ("_jit_fused_metadata_copy_module", "_jit_fused_metadata_copy_multi_module"):
            monkeypatch.setattr(metadata_copy, name, stand_ins.jit_module(name))
    for module in (manager, dsa_backend):
        monkeypatch.setattr(module, "print", stand_ins.quiet_print, raising=False)
    if not on_gpu:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
        monkeypatch.setattr(dsa_backend, "is_cuda", lambda: True)
        kernels = metadata_module(strip_asserts=True)
        for name in SGLANG_METADATA_KERNELS:
            monkeypatch.setattr(manager, name, getattr(kernels, name))
        cpu_glue_graphs(monkeypatch)
    return stand_ins


class _CpuGraph:
    """``torch.cuda.CUDAGraph`` as a metadata glue uses it, off a GPU: its capture records each
    prep call made in it (made, as a CUDA capture makes it, not run), a replay makes them again
    with the capture's arguments (the same buffers, the capture's host values)."""

    capturing: list = []  # the graphs being captured, innermost last

    def __init__(self):
        self.calls = []

    def replay(self) -> None:
        for call in self.calls:
            call()


@contextlib.contextmanager
def _cpu_capture(graph, **options):
    _CpuGraph.capturing.append(graph)
    try:
        yield
    finally:
        _CpuGraph.capturing.pop()


def cpu_glue_graphs(monkeypatch) -> None:
    """SGLang's ``MetadataGlueGraph`` off a GPU: its capture stream, graph and capture as
    :class:`_CpuGraph` simulates them, recording the calls of the plugin's ``GluedPrep`` (every
    prep a glue captures goes through one)."""
    from sglang_dsa_mtp.integration.dsa_metadata_glue import GluedPrep

    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _CpuGraph)
    monkeypatch.setattr(torch.cuda, "graph", _cpu_capture)
    prep = GluedPrep.init_forward_metadata_out_graph

    def recorded(self, forward_batch) -> None:
        if _CpuGraph.capturing:
            _CpuGraph.capturing[-1].calls.append(lambda: prep(self, forward_batch))
        else:
            prep(self, forward_batch)

    monkeypatch.setattr(GluedPrep, "init_forward_metadata_out_graph", recorded)


def _no_jit_kernel(*args, **kwargs):
    """SGLang's JIT metadata copy: it raises, and SGLang copies per step backend with torch."""
    raise RuntimeError("SGLang's JIT metadata copies stand aside in this harness")


def set_platform(monkeypatch, *, cuda: bool, hip: bool) -> None:
    """What SGLang's metadata manager and the plugin's gates (``devices.cuda_blocker``) see."""
    import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager

    from sglang_dsa_mtp import devices

    monkeypatch.setattr(manager, "is_cuda", lambda: cuda)
    monkeypatch.setattr(manager, "is_hip", lambda: hip)
    if hip:
        blocker = "HIP build of torch (ROCm test); the changes are CUDA-only"
    else:
        blocker = None if cuda else "not a CUDA platform (no CUDA device)"
    monkeypatch.setattr(devices, "cuda_blocker", lambda: blocker)


def load_plugin(monkeypatch) -> None:
    """What a server process does at start-up, on a CUDA platform as the plugin's gates see it:
    SGLang's ``load_plugins()`` runs this plugin's ``register()`` with its real tables and SGLang's
    ``HookRegistry`` applies the hooks. SGLang's loader state is emptied first (through
    ``monkeypatch``), so that every call applies the hooks afresh; undoing ``monkeypatch`` does not
    unapply them (the tests' ``sglang_targets_restored`` fixture does)."""
    import sglang.srt.plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsa_mtp import plugin
    from sglang_dsa_mtp.switches import SWITCHES

    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(sglang.srt.plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugin, "_status", None)
    monkeypatch.setenv("SGLANG_PLUGINS", plugin.ENTRY_POINT)
    # Registered as a server that opts in to the default-off switches registers, so that a test
    # may turn them on; they stay at their defaults while it runs unless it sets them.
    opt_in = [s.env for s in SWITCHES if not s.default and s.env not in os.environ]
    for env in opt_in:
        monkeypatch.setenv(env, "1")
    sglang.srt.plugins.load_plugins()
    for env in opt_in:
        monkeypatch.delenv(env)
    set_platform(monkeypatch, cuda=True, hip=False)


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
    """What a graph runner's capture does to the backend's metadata for ``bs`` (its seq-len fill,
    every slot 0)."""
    batch = graph_batch(bs, mode, seq_lens=[fill] * bs, req_pool_indices=[0] * bs, device=device)
    backend.init_forward_metadata_out_graph(batch, in_capture=True)


def replay(backend, mode, seq_lens, req_pool_indices, *, bs=None, device="cpu") -> None:
    """What a graph replay does to the backend's metadata for these requests, padded to the
    captured ``bs`` (length 1, slot 0) as the graph runners pad."""
    pad = (len(seq_lens) if bs is None else bs) - len(seq_lens)
    batch = graph_batch(
        len(seq_lens) + pad,
        mode,
        seq_lens=list(seq_lens) + [1] * pad,
        req_pool_indices=list(req_pool_indices) + [0] * pad,
        device=device,
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
    roots = [backend.decode_cuda_graph_metadata, vars(backend).get("_sglang_dsa_mtp")]
    bases = {}
    seen: set = set()
    for root in roots:
        for tensor in _tensors(root, seen):
            base = tensor if tensor._base is None else tensor._base
            bases[id(base)] = base
    return sum(base.untyped_storage().nbytes() for base in bases.values())


def metadata_tensors(metadata) -> dict[str, torch.Tensor]:
    """Every tensor of a captured ``DSAMetadata`` (its dataclass fields), by field name."""
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


class CpuDsaServer:
    """The DSA backends of one EAGLE launch at the CPU tables' width (:data:`SMALL_WIDTH` columns of
    ``req_to_token``, random tokens in every slot but slot 0, which SGLang keeps all zeros), with
    the stand-ins installed; ``monkeypatch`` undoes every change after the test."""

    POOL = 8  # request slots

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
        self.num_steps, self.draft_tokens = num_steps, draft_tokens
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(
            serving(
                (num_steps, 1, draft_tokens),
                kv_cache_dtype="auto",
                max_running_requests=None,
                dsa_decode_backend=decode_impl,
                dsa_prefill_backend="flashmla_sparse",
            )
        )
        self.stand_ins = cuda_stand_ins(monkeypatch, sms=8)
        self.calls = self.stand_ins.calls
        gen = torch.Generator().manual_seed(seed)
        req_to_token = torch.randint(
            0, 1 << 30, (self.POOL, SMALL_WIDTH), dtype=torch.int32, generator=gen
        )
        req_to_token[0] = 0
        self.runner = model_runner(
            context_len=SMALL_WIDTH - 4 - draft_tokens,
            page_size=page_size * kpool,
            req_to_token=req_to_token,
            hf_config=glm5_config(index_topk=SMALL_TOPK, index_kpool=kpool),
            fp8_kv_cache=False,
        )

    def close(self) -> None:
        self._stack.close()

    def target(self, max_bs: int):
        """The target model's backend, graph state sized for target verify."""
        backend = target_backend(self.runner)
        backend.init_cuda_graph_state(max_bs, max_bs * self.draft_tokens)
        return backend

    def draft_extend(self, max_bs: int):
        """The draft model's draft-extend backend (``DraftBackendFactory``: a plain DSA backend)."""
        return self.target(max_bs)

    def multi_step(self, max_bs: int, *, seeded: bool):
        """The draft model's MTP draft-decode backend: ``num_steps - 1`` step backends."""
        _, multi = draft_backends(self.runner, seeded=seeded)
        multi.init_cuda_graph_state(max_bs, max_bs)
        return multi

    def capture(self, backend, mode, batch_sizes) -> None:
        """Capture ``batch_sizes`` (largest first, as SGLang does)."""
        for bs in sorted(batch_sizes, reverse=True):
            capture(backend, bs, mode)

    def replay(self, backend, mode, lengths, slots, *, bs=None) -> None:
        replay(backend, mode, lengths, slots, bs=bs)
