"""SGLang's native DSA ops, real, on a GPU: each op SGLang 0.5.23's DSA path calls on SM90 around
the plugin's metadata, run as SGLang calls it and checked against an independent answer.

Where each op comes from (``support.real_ops``): DeepGEMM (the paged-MQA schedule and logits) from
the first sgl-deep-gemm release that imports and answers SGLang's schedule call, lazily bound;
FlashMLA (the scheduler metadata and the sparse decode) from its wheel; SGLang's JIT kernels (the
paged-MQA schedule of its DeepGEMM-less path, the top-k v2 plan and transform, the metadata copies)
built by SGLang's ``load_jit`` with nvcc. An op that cannot run on the machine is skipped with the
exact reason (the loader's error, its missing symbol, the missing tool); off a GPU every test skips.

- SGLang's JIT ``get_paged_mqa_logits_metadata`` (``dsv4``: its DSA prep's schedule under
  ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``), as the prep calls it (``[rows, 1]`` int32 lengths, block
  64, the SM count), against DeepGEMM's split of the work as SGLang's kernel documents it
  (:func:`expected_schedule`), bit for bit; DeepGEMM's own schedule against it;
- DeepGEMM's ``fp8_paged_mqa_logits`` (the indexer's logits: 64 heads x 128, an FP8 paged cache of
  64-token blocks with per-token scales) against SGLang's torch ``fp8_paged_mqa_logits_torch`` on
  every live column;
- SGLang's JIT ``plan_topk_v2`` and ``topk_transform_paged_v2`` (top-2048, raw indices and through a
  page table) against ``torch.topk`` of distinct scores;
- FlashMLA's sparse decode (SGLang's ``flash_mla_with_kvcache`` on an FP8 "V32" cache with
  SGLang's ``get_mla_metadata``, top-2048 indices) against attention in float32 over the
  dequantized cache (SGLang's ``dequantize_k_cache``);
- SGLang's JIT metadata copy (``_copy_base_replay_buffers`` through ``fused_metadata_copy_cuda``)
  against SGLang's own torch copies;
- ``sgl_kernel`` (sglang-kernel 0.4.10's SM90 ``common_ops``: what a DSA model's server needs
  besides the attention ops, its norms, rope, quantization and MoE): loaded, and its RMSNorm against
  float32 RMSNorm.

Lengths: seeded, with the edges 0, 1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049 and the
context.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from support import real_ops  # noqa: E402

pytestmark = pytest.mark.gpu

PAGE = 64  # DSA's page size and DeepGEMM's KV block
INDEX_HEADS, INDEX_DIM = 64, 128  # DeepSeek-V3.2 / GLM-5's indexer
TOPK = 2048
SPLIT_KV = 256  # the paged-MQA schedule's split, tokens
EDGES = (0, 1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049)


def lengths(rows: int, context: int, seed: int, *, least: int = 0) -> torch.Tensor:
    """``rows`` int32 lengths in [least, context] on the GPU: every third the edges and the context
    in turn (from the ``seed``-th), the rest log-uniform."""
    gen = torch.Generator().manual_seed(seed)
    edges = torch.tensor([*EDGES, context], dtype=torch.int64)
    edges = edges[(edges >= least) & (edges <= context)]
    drawn = torch.exp2(torch.rand(rows, generator=gen, dtype=torch.float64) * context.bit_length())
    row = torch.arange(rows)
    out = torch.where(row % 3 == 0, edges[(row // 3 + seed) % len(edges)], drawn)
    return out.long().clamp(least, context).to(torch.int32).cuda()


def _skip_unless(load):
    try:
        return load()
    except real_ops.Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def deep_gemm():
    module, where = _skip_unless(real_ops.import_deep_gemm)
    print(f"deep_gemm from {where}")
    return module


@pytest.fixture(scope="module")
def jit():
    tools = _skip_unless(real_ops.jit_toolchain)
    print(f"SGLang's JIT kernels built with {tools}")


@pytest.fixture(scope="module")
def flash_mla():
    module, where = _skip_unless(real_ops.import_flash_mla)
    print(f"flash_mla {module.__version__} from {where}")
    return module


def expected_schedule(context_lens: torch.Tensor, sms: int) -> torch.Tensor:
    """DeepGEMM's paged-MQA schedule, as SGLang's JIT kernel documents it: each row's 256-token
    splits counted in one prefix sum, split evenly over ``sms`` SMs (the last ``total % sms`` SMs
    one more); row ``i`` of the answer is where SM ``i``'s share starts, (request, split within
    it), and row ``sms`` is (rows, 0)."""
    splits = (context_lens.view(-1).long() + SPLIT_KV - 1) // SPLIT_KV
    prefix = splits.cumsum(0)
    rows = prefix.numel()
    total = int(prefix[-1]) if rows else 0
    share, rest = divmod(total, sms)
    sm = torch.arange(sms + 1, device=prefix.device)
    start = sm * share + (sm - (sms - rest)).clamp(min=0)
    request = torch.searchsorted(prefix, start, right=True)
    before = torch.cat([prefix.new_zeros(1), prefix])[request.clamp(max=rows)]
    offset = torch.where(request < rows, start - before, torch.zeros_like(start))
    return torch.stack([request, offset], 1).int()


@pytest.mark.parametrize("rows", [1, 4, 48, 240, 3000])
def test_sglangs_jit_paged_mqa_schedule_splits_the_work_as_deep_gemm(jit, rows):
    """SGLang's JIT schedule (``dsv4.get_paged_mqa_logits_metadata``, its DSA prep's schedule where
    DeepGEMM is absent: ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``) as the prep calls it, for decode rows
    (bs 1, 4, 48), verify rows (48 x 5) and a batch past its 2,048-row kernel: bit for bit
    :func:`expected_schedule` on the device's SM count; another set of lengths gives another
    schedule (the comparison can fail)."""
    from sglang.kernels.ops.attention.dsv4.attn import get_paged_mqa_logits_metadata

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seen = []
    for seed in range(6):
        context_lens = lengths(rows, 1 << 20, seed).view(-1, 1)
        schedule = get_paged_mqa_logits_metadata(context_lens, PAGE, sms)
        want = expected_schedule(context_lens, sms)
        assert schedule.shape == (sms + 1, 2) and schedule.dtype == torch.int32
        assert torch.equal(schedule, want), (seed, schedule[:4].tolist(), want[:4].tolist())
        seen.append(schedule)
    assert any(not torch.equal(seen[0], other) for other in seen[1:])


@pytest.mark.parametrize("rows", [1, 48, 240])
def test_deep_gemms_paged_mqa_schedule_is_sglangs_jit_schedule(deep_gemm, jit, rows):
    """DeepGEMM's schedule, as SGLang's prep calls it, bit for bit SGLang's JIT one."""
    from sglang.kernels.ops.attention.dsv4.attn import get_paged_mqa_logits_metadata

    sms = deep_gemm.get_num_sms()
    for seed in range(3):
        context_lens = lengths(rows, 1 << 20, seed).view(-1, 1)
        schedule = deep_gemm.get_paged_mqa_logits_metadata(context_lens, PAGE, sms)
        assert torch.equal(schedule, get_paged_mqa_logits_metadata(context_lens, PAGE, sms))


def _fp8_index_cache(blocks: int, gen: torch.Generator) -> torch.Tensor:
    """An indexer cache as DSA keeps it: per 64-token block, 64 x 128 FP8 values then 64 fp32
    scales; viewed ``[blocks, 64, 1, 132]`` uint8."""
    values = torch.randn(blocks, PAGE, INDEX_DIM, device="cuda", generator=gen)
    scales = torch.rand(blocks, PAGE, device="cuda", generator=gen) + 0.5
    cache = torch.empty(blocks, PAGE * (INDEX_DIM + 4), dtype=torch.uint8, device="cuda")
    cache[:, : PAGE * INDEX_DIM] = values.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    cache[:, PAGE * INDEX_DIM :] = scales.view(torch.uint8).flatten(1)
    return cache.view(blocks, PAGE, 1, INDEX_DIM + 4)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_deep_gemms_fp8_paged_mqa_logits_match_sglangs_torch_logits(deep_gemm, bs):
    """The indexer's logits of one decode row per request, over a paged FP8 cache (pages in a
    random order), equal to SGLang's torch path on every live column within float32 rounding."""
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    gen = torch.Generator(device="cuda").manual_seed(bs)
    pages = 80  # 5,120 columns
    context_lens = lengths(bs, pages * PAGE, bs, least=1)
    q = torch.randn(bs, 1, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen)
    q = q.to(torch.float8_e4m3fn)
    cache = _fp8_index_cache(bs * pages, gen)
    weights = torch.randn(bs, INDEX_HEADS, device="cuda", generator=gen)
    table = torch.randperm(bs * pages, device="cuda", generator=gen).int().view(bs, pages)
    sms = deep_gemm.get_num_sms()
    schedule = deep_gemm.get_paged_mqa_logits_metadata(context_lens.view(-1, 1), PAGE, sms)
    width = pages * PAGE
    logits = deep_gemm.fp8_paged_mqa_logits(
        q, cache, weights, context_lens.view(-1, 1), table, schedule, width, False
    )
    expected = fp8_paged_mqa_logits_torch(
        q, cache, weights, context_lens, table, None, width, False
    )
    assert logits.shape == (bs, width) and logits.dtype == torch.float32
    for row, length in enumerate(context_lens.tolist()):
        live, want = logits[row, :length], expected[row, :length]
        scale = float(want.abs().max()) if length else 1.0
        torch.testing.assert_close(live, want, rtol=1e-4, atol=1e-4 * scale, msg=f"row {row}")


@pytest.mark.parametrize("paged", [False, True], ids=["raw indices", "through the page table"])
def test_sglangs_jit_top_k_v2_selects_the_top_2048(jit, paged):
    """Rows of distinct scores with the edge lengths (0 and 2048 .. 2049 among them) up to 64k
    columns: the plan, then the transform; each row's output is the set of its top-min(len, 2048)
    columns (or their page-table slots), -1 after them."""
    from sglang.kernels.ops.attention.dsv4.topk import plan_topk_v2, topk_transform_paged_v2

    rows, width = 24, 1 << 16
    gen = torch.Generator(device="cuda").manual_seed(7)
    scores = torch.rand(rows, width, device="cuda", generator=gen, dtype=torch.float64)
    scores = scores.argsort(dim=1).float()  # distinct in each row
    row_lens = lengths(rows, width, 3)
    table = None
    if paged:
        table = torch.randperm(rows * width // PAGE, device="cuda", generator=gen).int()
        table = table.view(rows, width // PAGE)
    plan = plan_topk_v2(row_lens)
    out = torch.full((rows, TOPK), -7, dtype=torch.int32, device="cuda")
    topk_transform_paged_v2(scores, row_lens, table, out, PAGE, plan)
    for row, length in enumerate(row_lens.tolist()):
        k = min(length, TOPK)
        chosen = scores[row, :length].topk(k).indices if k else scores.new_empty(0).long()
        if paged:
            chosen = table[row, chosen // PAGE].long() * PAGE + chosen % PAGE
        got = out[row]
        assert sorted(got[:k].tolist()) == sorted(chosen.tolist()), (row, length)
        assert bool((got[k:] == -1).all()), (row, length)


@pytest.mark.parametrize("bs", [1, 4])
def test_flashmlas_sparse_decode_matches_attention_over_the_dequantized_cache(flash_mla, bs):
    """SGLang's ``flash_mla_with_kvcache`` as its ``flashmla_kv`` decode calls it (64 query heads,
    576 = 512 + 64 dims, an FP8 V32 cache of 64-token pages, top-2048 token indices padded with
    -1, SGLang's ``get_mla_metadata``): each row's output within bf16 rounding of softmax attention
    in float32 over the dequantized keys it selects."""
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache
    from sglang.kernels.ops.attention.flash_mla_interface import (
        flash_mla_with_kvcache,
        get_mla_metadata,
    )
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache

    heads, dim, dim_v = 64, 576, 512
    gen = torch.Generator(device="cuda").manual_seed(bs)
    pages = 48
    keys = torch.randn(pages, PAGE, 1, dim, device="cuda", generator=gen).bfloat16()
    cache = quantize_k_cache(keys)
    dequantized = dequantize_k_cache(cache).view(pages * PAGE, dim).float()
    live = lengths(bs, pages * PAGE, 11 + bs, least=1).clamp(max=TOPK)
    indices = torch.full((bs, 1, TOPK), -1, dtype=torch.int32, device="cuda")
    for row, n in enumerate(live.tolist()):
        picked = torch.randperm(pages * PAGE, device="cuda", generator=gen)[:n]
        indices[row, 0, :n] = picked.int()
    q = torch.randn(bs, 1, heads, dim, device="cuda", generator=gen).bfloat16()
    scale = dim**-0.5
    tiles, splits = get_mla_metadata(
        cache_seqlens=live,
        num_q_tokens_per_head_k=heads,
        num_heads_k=1,
        num_heads_q=heads,
        is_fp8_kvcache=True,
        topk=TOPK,
    )
    out, _ = flash_mla_with_kvcache(
        q=q,
        k_cache=cache.view(pages, PAGE, 1, -1),
        block_table=torch.empty((bs, 0), dtype=torch.int32, device="cuda"),
        cache_seqlens=live,
        head_dim_v=dim_v,
        tile_scheduler_metadata=tiles,
        num_splits=splits,
        softmax_scale=scale,
        indices=indices,
        is_fp8_kvcache=True,
        kv_format="V32",
    )
    assert out.shape == (bs, 1, heads, dim_v)
    for row, n in enumerate(live.tolist()):
        selected = dequantized[indices[row, 0, :n].long()]
        weights = torch.softmax(q[row, 0].float() @ selected.T * scale, dim=-1)
        want = weights @ selected[:, :dim_v]
        torch.testing.assert_close(out[row, 0].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["decode", "target verify"])
@pytest.mark.parametrize("extras", [False, True], ids=["bare", "real page table and FlashMLA"])
def test_sglangs_jit_metadata_copy_writes_what_its_torch_copies_write(jit, mode, extras):
    """SGLang's ``_copy_base_replay_buffers`` (the MTP precompute's copies into a draft step's
    metadata) through its JIT ``fused_metadata_copy_cuda``, and again with that kernel raising so
    that SGLang's torch copies run: on poisoned destinations wider than the sources, every
    destination tensor equal bit for bit, and the JIT kernel ran (without raising) in the first."""
    import sglang.kernels.ops.attention.dsa.fused_metadata_copy as fused
    from sglang.srt.layers.attention.dsa.dsa_metadata_manager import DSAMetadataManagementMixin
    from sglang.srt.layers.attention.dsa_backend import DSAFlashMLAMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from support.constants import POISON

    bs, next_n, width = 5, 4, 1024
    rows = bs * next_n if mode == "target verify" else bs
    gen = torch.Generator(device="cuda").manual_seed(rows + extras)

    def ints(*shape) -> torch.Tensor:
        return torch.randint(0, 1 << 30, shape, generator=gen, device="cuda", dtype=torch.int32)

    flashmla = None
    if extras:
        flashmla = DSAFlashMLAMetadata(flashmla_metadata=ints(132, 8), num_splits=ints(rows + 1))
    source = SimpleNamespace(
        cache_seqlens=ints(bs),
        cu_seqlens_k=ints(bs + 1),
        page_indices=ints(rows, width),
        dsa_cache_seqlens=ints(rows),
        seqlens_expanded=ints(rows) if mode == "target verify" else None,
        dsa_cu_seqlens_k=ints(rows + 1),
        real_page_table=ints(rows, width // PAGE) if extras else None,
        flashmla_metadata=flashmla,
        max_len=width,
        max_seqlen_k=width,
        seqlens_expanded_size=rows,
    )

    def destination() -> SimpleNamespace:
        def poisoned(*shape) -> torch.Tensor:
            return torch.full(shape, POISON, dtype=torch.int32, device="cuda")

        return SimpleNamespace(
            cache_seqlens_int32=poisoned(bs),
            cu_seqlens_k=poisoned(bs + 1),
            page_table_1=poisoned(rows, 2 * width),
            dsa_cache_seqlens_int32=poisoned(rows),
            dsa_seqlens_expanded=poisoned(rows),
            dsa_cu_seqlens_k=poisoned(rows + 2),
            real_page_table=poisoned(rows, 2 * width // PAGE),
            flashmla_metadata=DSAFlashMLAMetadata(
                flashmla_metadata=poisoned(132, 8), num_splits=poisoned(rows + 2)
            ),
        )

    forward_mode = ForwardMode.TARGET_VERIFY if mode == "target verify" else ForwardMode.DECODE
    copy = DSAMetadataManagementMixin._copy_base_replay_buffers
    ran = []
    kernel = fused.fused_metadata_copy_cuda

    def counted(*args, **kwargs):
        kernel(*args, **kwargs)
        ran.append(True)

    def raising(*args, **kwargs):
        raise RuntimeError("the JIT copy stands aside: SGLang's torch copies run")

    written = {}
    for label, stand_in in (("jit", counted), ("torch", raising)):
        out = destination()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused, "fused_metadata_copy_cuda", stand_in)
            copy(None, bs, out, source, forward_mode)
        torch.cuda.synchronize()
        written[label] = out
    assert ran == [True]
    jit_out, torch_out = written["jit"], written["torch"]
    for name, value in vars(torch_out).items():
        pairs = [(name, value, getattr(jit_out, name))]
        if isinstance(value, DSAFlashMLAMetadata):
            theirs = getattr(jit_out, name)
            pairs = [
                (f"{name}.{field}", getattr(value, field), getattr(theirs, field))
                for field in ("flashmla_metadata", "num_splits")
            ]
        for label, want, got in pairs:
            assert torch.equal(got, want), label


def test_sgl_kernel_loads_and_its_rmsnorm_normalises():
    """What a real server of a DSA model needs besides the attention ops: ``sgl_kernel`` loads (in
    a process of its own) and its RMSNorm of a bf16 batch is float32 RMSNorm within bf16 rounding
    (``|got - ref| <= 0.02 + 0.02 |ref|``); else skipped with the loader's reason."""
    error, where = _skip_unless(real_ops.sgl_kernel_rmsnorm)
    print(f"sgl_kernel from {where}: largest |got - ref| - 0.02 |ref| = {error:.3g}")
    assert error <= 2e-2
