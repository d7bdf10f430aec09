"""Chunked indexer logits with live columns only, in SGLang's real ``Indexer._get_topk_paged``.

The indexer is SGLang's ``Indexer``, built by its constructor from transformers' DeepSeek-V3.2
config (its rotary embedding, which ``_get_topk_paged`` does not use, needs vllm on the CPU and is
replaced by an identity), reading a real ``DSATokenToKVPool`` through SGLang's forward context, with
SGLang's ``DSAMetadata`` and ``DSAIndexerMetadata``. Logits come from SGLang's torch paged-MQA logits
(``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1``) and the top-k from its torch backend (``--dsa-topk-backend
torch``, unfused). DeepGEMM's chunk schedule, which the torch logits ignore, is
``indexer_cases.paged_mqa_schedule``: SGLang's schedule in torch, a function of every length, so
that every logits call can be compared with the call SGLang's own closure makes, argument by
argument (``CallRecorder``). On the CPU the SM count (the chunk size) is shrunk to 4 and the width
is 2176 columns; on a GPU (tests marked ``gpu``) the indexer is built on the device with SGLang's
own SM count, at rows below, at and above it, eagerly and in CUDA graphs replayed with new lengths.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

import sglang.kernels.ops.attention.dsa.paged_mqa_logits as paged_mqa_logits
import sglang.srt.layers.attention.dsa.utils as dsa_utils
import sglang.srt.layers.attention.dsa_backend as dsa_backend
from sglang.srt.configs.model_config import dsa_layer_skips_topk
from sglang.srt.layers.attention.dsa import dsa_indexer
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend, DSAMetadata
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_context
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.integration import dsa_indexer_live_logits as hook
from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live
from sglang_dsa_mtp.switches import LIVE_WIDTH
from support import dsa_backends as kit
from support.compiles import count_compiles
from support.indexer_cases import CallRecorder, call_differences, paged_mqa_schedule

SM_COUNT = 4
PAGES_PER_ROW = 34
WIDTH = PAGES_PER_ROW * 64  # 2176 columns: past 2049
TOPK = 64
# Where the rows of a scenario end: KV-block and 128-column edges, 2048, the full width.
ROW_ENDS = [WIDTH, 2049, 129, 0, 64, 1, 2048, 127, 65, 63, 128, 2047, WIDTH - 1]
SPLIT = "sglang.kernels.ops.attention.dsa.paged_mqa_logits.deepgemm_paged_mqa_logits_split"
# In a dict: SGLang's hook propagation rebinds every module global that holds the original.
UNHOOKED = {"split": paged_mqa_logits.deepgemm_paged_mqa_logits_split}


@pytest.fixture
def torch_paged_mqa(monkeypatch):
    """SGLang resolves its torch paged-MQA logits (``dsa_backends.torch_logits``, which also gives
    the device's SM count) and ``paged_mqa_schedule``, with top-k fusion off."""
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    monkeypatch.setattr(
        dsa_indexer, "resolve_paged_mqa_logits_metadata_fn", lambda: paged_mqa_schedule
    )
    override = get_context().override_server_args()
    override.install()
    with kit.torch_logits():
        yield
    override.restore()


def build_indexer(*, sm_count=SM_COUNT, **config):
    """SGLang's ``Indexer`` from DeepSeek-V3.2's config (``config`` overrides), on the default
    device; its SM count set to ``sm_count`` (None: SGLang's own, which it sets on CUDA only)."""
    indexer = kit.sglang_indexer(
        DeepseekV32Config(index_topk=TOPK, **config), torch.get_default_device()
    )
    if sm_count is not None:
        indexer.sm_count = sm_count
    return indexer


class Batch:
    """One indexer call of a forward mode: its KV pool, metadata, queries and head weights.

    Each request reads ``pages_per_row`` random pages of the pool: distinct pages of a pool just
    large enough by default, or of a pool of ``pool_pages`` pages (shared between requests).
    :meth:`set_lengths` writes new lengths and pages into the same tensors, as SGLang's replay
    preparation does before a graph replay."""

    def __init__(
        self,
        mode,
        seq_lens,
        next_n,
        *,
        heads,
        padded_rows=0,
        seed=0,
        device="cpu",
        pages_per_row=PAGES_PER_ROW,
        pool_pages=None,
        sm_count=SM_COUNT,
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.mode, self.next_n, self.device, self.sm_count = mode, next_n, device, sm_count
        self.bs, self.pages_per_row = len(seq_lens), pages_per_row
        rows = self.bs * next_n
        self.forward_batch = SimpleNamespace(forward_mode=mode)
        distinct = pool_pages is None
        self.pool = DSATokenToKVPool(
            size=64 * (self.bs * pages_per_row + 1 if distinct else pool_pages),
            page_size=64,
            kv_lora_rank=512,
            dtype=torch.bfloat16,
            qk_rope_head_dim=64,
            layer_num=1,
            device=device,
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=576,
        )
        index_k = self.pool.get_index_k_with_scale_buffer(layer_id=0)
        self.pages = index_k.shape[0]
        values = torch.randn(self.pages, 64 * 128, generator=self.gen).to(torch.float8_e4m3fn)
        scales = torch.rand(self.pages, 64, generator=self.gen) + 0.5
        index_k.copy_(torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=1))
        cache_seqlens, expanded, ctx_lens, schedule = self._lengths(seq_lens)
        self.metadata = DSAIndexerMetadata(
            attn_metadata=DSAMetadata(
                page_size=64,
                cache_seqlens_int32=cache_seqlens,
                max_seq_len_q=next_n,
                max_seq_len_k=64 * pages_per_row,
                cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
                cu_seqlens_k=None,
                page_table_1=None,
                real_page_table=self._page_table(distinct),
                dsa_cache_seqlens_int32=expanded.clamp(max=TOPK),
                dsa_cu_seqlens_q=None,
                dsa_cu_seqlens_k=None,
                dsa_extend_seq_lens_list=[next_n] * self.bs,
                dsa_seqlens_expanded=expanded,
                paged_mqa_schedule_metadata=schedule,
                paged_mqa_ctx_lens_2d=ctx_lens,
            ),
            topk_transform_method=TopkTransformMethod.PAGED,
            topk_backend=DSATopKBackend.TORCH,
        )
        self.rows = rows
        self.q_fp8 = (
            torch.randn(rows + padded_rows, heads, 128, generator=self.gen)
            .to(torch.float8_e4m3fn)
            .to(device)
        )
        self.weights = torch.randn(rows + padded_rows, heads, 1, generator=self.gen).to(device)

    def _lengths(self, seq_lens):
        """``(cache_seqlens, expanded, ctx_lens_2d, schedule)`` as SGLang's DSA backend builds them."""
        seq = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        if self.mode.is_decode():
            cache_seqlens, expanded = seq, seq
        else:  # target verify / draft extend: row j of a request sees its prefix + j + 1 tokens
            cache_seqlens = seq + self.next_n
            offsets = torch.arange(self.next_n, dtype=torch.int32, device=self.device)
            expanded = (seq.repeat_interleave(self.next_n) + offsets.repeat(self.bs) + 1).to(
                torch.int32
            )
        backend = SimpleNamespace(
            speculative_num_draft_tokens=self.next_n if self.next_n > 1 else None
        )
        ctx_lens = DeepseekSparseAttnBackend._build_paged_mqa_schedule_2d_ctx_lens(
            backend, self.mode, cache_seqlens, expanded, self.bs
        )
        return cache_seqlens, expanded, ctx_lens, paged_mqa_schedule(ctx_lens, 64, self.sm_count)

    def _page_table(self, distinct: bool) -> torch.Tensor:
        if distinct:
            pages = torch.randperm(self.pages - 1, generator=self.gen)[
                : self.bs * self.pages_per_row
            ]
            table = pages.view(self.bs, self.pages_per_row) + 1
        else:
            table = torch.stack(
                [
                    torch.randperm(self.pages - 1, generator=self.gen)[: self.pages_per_row] + 1
                    for _ in range(self.bs)
                ]
            )
        return table.to(torch.int32).repeat_interleave(self.next_n, 0).to(self.device)

    def set_lengths(self, seq_lens) -> None:
        """New lengths and pages, written into the tensors the indexer reads."""
        attn = self.metadata.attn_metadata
        new = self._lengths(seq_lens)
        for tensor, value in zip(
            (
                attn.cache_seqlens_int32,
                attn.dsa_seqlens_expanded,
                attn.paged_mqa_ctx_lens_2d,
                attn.paged_mqa_schedule_metadata,
            ),
            new,
        ):
            tensor.copy_(value)
        attn.dsa_cache_seqlens_int32.copy_(new[1].clamp(max=TOPK))
        attn.real_page_table.copy_(self._page_table(False))

    def topk(self, indexer):
        """SGLang's ``Indexer._get_topk_paged`` on this batch."""
        ctx = ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=self.pool))
        with forward_context(ctx):
            return indexer._get_topk_paged(
                self.forward_batch, 0, self.q_fp8, self.weights, self.metadata
            )


@pytest.fixture
def live_calls(monkeypatch):
    """Every call of the live-column path, recorded (it still runs)."""
    calls = []
    run = live.chunked_paged_mqa_logits_live

    def recorded(*args, **kwargs):
        calls.append(kwargs["chunk_rows"])
        return run(*args, **kwargs)

    monkeypatch.setattr(live, "chunked_paged_mqa_logits_live", recorded)
    return calls


@pytest.fixture
def logits_calls(hooked, torch_paged_mqa):
    """Every call of the paged-MQA logits function and of the schedule function (SGLang's torch
    logits, ``paged_mqa_schedule``), with its arguments as they were, recorded; both still run."""
    recorder = CallRecorder(dsa_utils.resolve_fp8_paged_mqa_logits_fn())
    hooked.setattr(dsa_indexer, "resolve_fp8_paged_mqa_logits_fn", lambda: recorder.logits_fn)
    hooked.setattr(
        dsa_indexer, "resolve_paged_mqa_logits_metadata_fn", lambda: recorder.schedule_fn
    )
    return recorder


def stock_and_ours(hooked, indexer, batch):
    """The batch's top-k with the switch off (SGLang's concat) and on (the live copy)."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    stock = batch.topk(indexer)
    hooked.delenv(LIVE_WIDTH.env)
    return stock, batch.topk(indexer)


def stock_and_ours_calls(hooked, indexer, batch, calls):
    """:func:`stock_and_ours`, each top-k with the logits and schedule calls its arm made."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    stock = batch.topk(indexer), calls.take()
    hooked.delenv(LIVE_WIDTH.env)
    return stock, (batch.topk(indexer), calls.take())


# --- the hook rows ----------------------------------------------------------------------------------


@pytest.mark.quick
def test_plugin_hooks_the_split_function_and_the_indexer_constructor():
    rows = {(row.target, row.hook_type.value) for row in hooks.rows_of(LIVE_WIDTH)}
    assert (SPLIT, "around") in rows
    assert ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.__init__", "after") in rows


def test_the_indexer_calls_the_hooked_split_function(hooked):
    wrapped = dsa_indexer.deepgemm_paged_mqa_logits_split
    assert wrapped is not UNHOOKED["split"] and wrapped.__wrapped__ is UNHOOKED["split"]


# --- SGLang's forward modes past the SM count --------------------------------------------------------

MODES = [
    pytest.param(ForwardMode.TARGET_VERIFY, 4, id="target-verify-eagle-3-1-4"),
    pytest.param(ForwardMode.DRAFT_EXTEND_V2, 5, id="draft-extend-eagle-4-1-5"),
    pytest.param(ForwardMode.DECODE, 1, id="decode"),
]


@pytest.mark.parametrize("mode,next_n", MODES)
@pytest.mark.parametrize("chunks", [2, 4], ids=["2-chunks", "4-chunks"])
def test_chunked_forward_modes_select_sglang_top_k_indices(
    hooked, torch_paged_mqa, live_calls, mode, next_n, chunks
):
    requests = -(-((chunks - 1) * SM_COUNT + 1) // next_n)
    prefixes = [max(0, end - next_n) for end in ROW_ENDS[:requests]]
    batch = Batch(mode, prefixes, next_n, heads=16, seed=chunks)
    assert -(-batch.rows // SM_COUNT) == chunks
    stock, ours = stock_and_ours(hooked, build_indexer(), batch)
    assert live_calls == [SM_COUNT], "the live-column path ran once, in chunks of the SM count"
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("mode,next_n", MODES)
def test_each_logits_call_gets_the_arguments_sglang_closure_gives_it(
    hooked, logits_calls, mode, next_n
):
    """Past the SM count the hook calls SGLang's closure chunk by chunk: every schedule call
    (context lengths, block size, SM count) and every logits call (queries, KV cache, head
    weights, context lengths, block table, DeepGEMM schedule, width, clean flag) equals, in order
    and byte for byte, the one SGLang's closure makes for the same batch."""
    prefixes = [max(0, end - next_n) for end in ROW_ENDS]
    batch = Batch(mode, prefixes, next_n, heads=16, seed=5)
    (stock, stock_calls), (ours, our_calls) = stock_and_ours_calls(
        hooked, build_indexer(), batch, logits_calls
    )
    assert [kind for kind, _ in stock_calls] == ["schedule", "logits"] * chunks_of(batch)
    assert call_differences(our_calls, stock_calls) == []
    assert torch.equal(ours, stock)


def test_the_schedule_shares_256_token_splits_over_the_sms_as_sglangs_kernel():
    """Splits 0, 1, 2 and 4 (7 in all) over 3 SMs: 2, 2 and 3; each boundary's (row, split)."""
    lengths = torch.tensor([[0], [256], [257], [1000]], dtype=torch.int32)
    assert paged_mqa_schedule(lengths, 64, 3).tolist() == [[1, 0], [2, 1], [3, 1], [4, 0]]
    assert paged_mqa_schedule(lengths[:0], 64, 2).tolist() == [[0, 0]] * 3


def test_the_call_comparison_names_the_argument_that_differs():
    recorder = CallRecorder(lambda *args, **kwargs: None)
    lengths = torch.tensor([[5], [300]], dtype=torch.int32)
    for num_sms in (4, 5):
        recorder.schedule_fn(lengths, 64, num_sms)
        recorder.logits_fn(lengths, None, None, lengths, lengths, None, 128)
    calls = recorder.take()
    first, second = calls[:2], calls[2:]
    assert call_differences(first, first) == []
    assert call_differences(second, first) == ["call 0 (schedule): num_sms 5, SGLang's 4"]
    assert call_differences(first[:1], first) == ["1 calls, SGLang's closure makes 2"]


@pytest.mark.quick
def test_masked_init_and_local_tokens_select_sglang_top_k_indices(
    hooked, torch_paged_mqa, live_calls
):
    """Rows shorter than the init/local windows: SGLang's masking writes past their live columns."""
    indexer = build_indexer(index_init_tokens=3, index_local_tokens=2)
    batch = Batch(ForwardMode.TARGET_VERIFY, [0, 1, 60, 2000, WIDTH - 4], 4, heads=16, seed=1)
    stock, ours = stock_and_ours(hooked, indexer, batch)
    assert live_calls and torch.equal(ours, stock)


def test_padded_query_rows_get_sglang_padding(hooked, torch_paged_mqa, live_calls):
    batch = Batch(ForwardMode.TARGET_VERIFY, [100, 700], 4, heads=16, padded_rows=3, seed=2)
    stock, ours = stock_and_ours(hooked, build_indexer(), batch)
    assert live_calls and ours.shape == (batch.rows + 3, TOPK) and torch.equal(ours, stock)


def test_at_most_sm_count_rows_take_sglang_path_without_concat(hooked, torch_paged_mqa, live_calls):
    batch = Batch(ForwardMode.TARGET_VERIFY, [10], SM_COUNT, heads=16)
    stock, ours = stock_and_ours(hooked, build_indexer(), batch)
    assert live_calls == [] and torch.equal(ours, stock)


# --- on a GPU: SGLang's own SM count, eagerly and in CUDA graphs replayed with new lengths ---------

GPU_PAGES_PER_ROW = 1024  # 65536 columns
GPU_POOL_PAGES = 4096
GPU_MODES = [
    pytest.param(ForwardMode.TARGET_VERIFY, 4, id="target-verify-eagle-3-1-4"),
    pytest.param(ForwardMode.DRAFT_EXTEND_V2, 4, id="draft-extend-eagle-3-1-4"),
    pytest.param(ForwardMode.DECODE, 1, id="decode"),
]
# Requests of a batch, from the SM count and the rows per request: rows below the SM count, at it
# (exactly where it divides, as an H200's 132 does by 1 and 4), one request past it, three chunks.
PLACES = {
    "below": lambda sms, next_n: (sms - 1) // next_n,
    "at": lambda sms, next_n: sms // next_n,
    "above": lambda sms, next_n: sms // next_n + 1,
    "three-chunks": lambda sms, next_n: 2 * sms // next_n + 1,
}


def gpu_prefixes(bs: int, next_n: int, width: int, gen: torch.Generator) -> list[int]:
    """``bs`` prefixes in random order: the edges (0, 1, around a KV block, 128 columns and 2048,
    the width) first, then uniform draws up to the width (most of them past 16k)."""
    top = width - next_n
    edges = [0, 1, 63, 64, 65, 127, 128, 2047, 2048, 2049, top]
    draws = torch.randint(0, top + 1, (bs,), generator=gen).tolist()
    prefixes = (edges + draws)[:bs]
    return [prefixes[i] for i in torch.randperm(bs, generator=gen).tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("mode,next_n", GPU_MODES)
def test_on_a_gpu_top_k_equals_stock_eagerly_and_in_cuda_graphs_replayed_with_new_lengths(
    hooked, logits_calls, live_calls, mode, next_n, place
):
    """SGLang's indexer built on the GPU (its SM count SGLang's own, the copy kernel compiled by the
    constructor's hook): eagerly, the top-k and every logits and schedule call equal stock's; then
    each arm captured in a CUDA graph, and three replays with new lengths and pages give the top-k
    SGLang computes eagerly for them, with no Triton compile from the first call on."""
    with torch.device("cuda"):
        indexer = build_indexer(sm_count=None)
    sms = indexer.sm_count
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert live.is_warm(torch.device("cuda")), "the constructor's hook compiled the copy kernel"
    gen = torch.Generator().manual_seed(next_n * 10 + list(PLACES).index(place))
    width = 64 * GPU_PAGES_PER_ROW
    batch = Batch(
        mode,
        gpu_prefixes(PLACES[place](sms, next_n), next_n, width, gen),
        next_n,
        heads=64,
        seed=int(torch.randint(1 << 30, (1,), generator=gen)),
        device="cuda",
        pages_per_row=GPU_PAGES_PER_ROW,
        pool_pages=GPU_POOL_PAGES,
        sm_count=sms,
    )
    with count_compiles() as compiles:
        (stock, stock_calls), (ours, our_calls) = stock_and_ours_calls(
            hooked, indexer, batch, logits_calls
        )
        assert live_calls == ([sms] if batch.rows > sms else [])
        assert call_differences(our_calls, stock_calls) == []
        assert torch.equal(ours, stock)
        graphs = {}
        for arm, switch in (("stock", "0"), ("ours", None)):
            if switch is None:
                hooked.delenv(LIVE_WIDTH.env)
            else:
                hooked.setenv(LIVE_WIDTH.env, switch)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = batch.topk(indexer)
            graphs[arm] = graph, out
        for replay in range(3):
            batch.set_lengths(gpu_prefixes(batch.bs, next_n, width, gen))
            for graph, _ in graphs.values():
                graph.replay()
            hooked.setenv(LIVE_WIDTH.env, "0")
            expected = batch.topk(indexer)
            hooked.delenv(LIVE_WIDTH.env)
            torch.cuda.synchronize()
            assert torch.equal(graphs["stock"][1], expected), f"SGLang's own graph, replay {replay}"
            assert torch.equal(graphs["ours"][1], expected), f"replay {replay}"
    assert compiles.names == [], compiles.describe()
    graphs.clear()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 65, 132, 133, 2048, 2049, 5000])
def test_on_a_gpu_the_schedule_stand_in_is_sglangs_schedule(rows):
    """``paged_mqa_schedule`` (the tests' schedule) equals SGLang's own under
    ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``, its JIT kernel (built with nvcc on first use), on
    random lengths up to 1M with the edges, for the device's SM count and one."""
    from sglang.kernels.ops.attention.dsv4 import get_paged_mqa_logits_metadata

    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(0, 1 << 20, (rows,), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0, 1, 255, 256, 257, 1 << 20], dtype=torch.int32)[:rows]
    lengths[: len(edges)] = edges
    lengths = lengths.view(-1, 1).cuda()
    for sms in (torch.cuda.get_device_properties(0).multi_processor_count, 1):
        expected = get_paged_mqa_logits_metadata(lengths, 64, sms)
        assert torch.equal(paged_mqa_schedule(lengths, 64, sms), expected), f"{sms} SMs"


# --- fallbacks --------------------------------------------------------------------------------------


def chunked_batch():
    return Batch(ForwardMode.TARGET_VERIFY, [70, 1000, 3], 4, heads=16, seed=3)


@pytest.mark.parametrize("value", ["0", "off"], ids=["off", "unparsable"])
def test_the_kill_switch_keeps_sglang_concat(hooked, torch_paged_mqa, live_calls, value):
    hooked.setenv(LIVE_WIDTH.env, value)
    chunked_batch().topk(build_indexer())
    assert live_calls == []


def test_a_live_width_hook_sglang_left_unapplied_keeps_sglang_concat(
    hooked, unapplied, torch_paged_mqa, live_calls, caplog
):
    why = unapplied("Indexer.__init__")  # the start-up compile: else the copy compiles serving
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        chunked_batch().topk(build_indexer())
    assert live_calls == []
    assert why in caplog.text


def test_a_gate_that_raises_keeps_sglang_concat_with_one_error(
    hooked, torch_paged_mqa, live_calls, caplog
):
    def raising(*args):
        raise RuntimeError("injected failure")

    hooked.setattr(hook, "_why_not_live", raising)
    batch, indexer = chunked_batch(), build_indexer()
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        batch.topk(indexer)
        batch.topk(indexer)
    assert live_calls == []
    assert errors_in(caplog) == [
        "sglang_dsa_mtp: chunked indexer logits keep SGLang's full-width concat: the gate "
        "raised: RuntimeError: injected failure"
    ]


def test_a_kernel_not_compiled_at_start_up_keeps_sglang_concat(
    hooked, torch_paged_mqa, live_calls, caplog
):
    hooked.setattr(live, "is_warm", lambda device: False)
    batch, indexer = chunked_batch(), build_indexer()
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        batch.topk(indexer)
        batch.topk(indexer)
    assert live_calls == []
    assert caplog.text.count("was not compiled for cpu at start-up") == 1


def chunks_of(batch) -> int:
    return -(-batch.rows // SM_COUNT)


def errors_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_copy_that_raises_mid_call_falls_back_to_sglang_and_its_shape_stays_there(
    hooked, torch_paged_mqa, live_calls, caplog
):
    """A launch failing after the first chunk (nothing a check finds ahead): SGLang's concat
    answers that call, logged once; the next call of that shape goes to SGLang directly."""
    batch, indexer = chunked_batch(), build_indexer()
    hooked.setenv(LIVE_WIDTH.env, "0")
    stock = batch.topk(indexer)
    hooked.delenv(LIVE_WIDTH.env)
    launch, launches = live._launch_copy, []

    def second_launch_raises(*args):
        launches.append(args)
        if len(launches) == 2:
            raise RuntimeError("boom")
        return launch(*args)

    hooked.setattr(live, "_launch_copy", second_launch_raises)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert torch.equal(batch.topk(indexer), stock)
        assert torch.equal(batch.topk(indexer), stock)
    assert len(live_calls) == 1 and len(launches) == 2, "the second call never tried ours"
    [error] = errors_in(caplog)
    assert error.endswith("SGLang's concat takes calls of that shape: RuntimeError: boom")


def test_a_chunk_the_kernel_does_not_take_is_copied_whole_without_recomputing(
    hooked, torch_paged_mqa, live_calls, caplog
):
    """DeepGEMM's chunks always fit the copy kernel's one variant; should one not, it is copied
    whole (as torch.cat copies it), every chunk is computed once, and the shape goes to SGLang."""
    batch, indexer = chunked_batch(), build_indexer()
    hooked.setenv(LIVE_WIDTH.env, "0")
    stock = batch.topk(indexer)
    hooked.delenv(LIVE_WIDTH.env)
    computed = []
    resolve = dsa_indexer.resolve_fp8_paged_mqa_logits_fn

    def odd_row_stride(q, *args, **kwargs):
        computed.append(q.shape[0])
        logits = resolve()(q, *args, **kwargs)
        padded = torch.zeros(logits.shape[0], logits.shape[1] + 1)
        padded[:, : logits.shape[1]] = logits
        return padded[:, : logits.shape[1]]

    hooked.setattr(dsa_indexer, "resolve_fp8_paged_mqa_logits_fn", lambda: odd_row_stride)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert torch.equal(batch.topk(indexer), stock)
        first = len(computed)
        assert torch.equal(batch.topk(indexer), stock)
    assert first == chunks_of(batch), "each chunk computed once"
    assert len(live_calls) == 1, "the next call of the shape went to SGLang"
    assert errors_in(caplog) == [], "a whole copy gives the right logits: a warning, not an error"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "a chunk of indexer logits was copied whole" in warning and "row stride" in warning


def test_every_argument_is_checked_before_the_first_chunk(
    hooked, torch_paged_mqa, live_calls, caplog
):
    """An argument that fails its check costs no logits computation of ours."""
    batch, indexer = chunked_batch(), build_indexer()
    computed = []
    resolve = dsa_indexer.resolve_fp8_paged_mqa_logits_fn

    def counting(q, *args, **kwargs):
        computed.append(q.shape[0])
        return resolve()(q, *args, **kwargs)

    def bad_destination(*args):
        raise ValueError("lengths needs more entries")

    hooked.setattr(dsa_indexer, "resolve_fp8_paged_mqa_logits_fn", lambda: counting)
    hooked.setattr(live, "_check_destination", bad_destination)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        batch.topk(indexer)
    sglang_chunks = [min(SM_COUNT, batch.rows - s) for s in range(0, batch.rows, SM_COUNT)]
    assert computed == sglang_chunks, "SGLang's chunks only"
    [error] = errors_in(caplog)
    assert error.endswith("ValueError: lengths needs more entries")


def test_another_logits_function_takes_sglang_path(hooked, live_calls):
    """Only SGLang's chunked closure is recognised; anything else is SGLang's business."""
    seen = []

    def logits_fn(q, *args, **kwargs):
        seen.append(q.shape)
        return torch.zeros(q.shape[0], 64)

    q = torch.zeros(9, 2, 128)
    lens = torch.ones(9, 1, dtype=torch.int32)
    out = dsa_indexer.deepgemm_paged_mqa_logits_split(
        logits_fn, q, None, torch.zeros(9, 2), lens, None, None, 64, q_offset=9
    )
    assert out.shape == (9, 64) and seen == [(9, 1, 2, 128)] and live_calls == []


def test_sglang_closure_yields_the_indexer_sm_count_and_block_size(hooked, torch_paged_mqa):
    """The closure the split function receives is recognised, with its own chunking parameters."""
    seen = []
    real = hook.sglang_closure
    hooked.setattr(hook, "sglang_closure", lambda fn: seen.append(real(fn)) or seen[-1])
    chunked_batch().topk(build_indexer())
    [closure] = seen
    assert (closure.sm_count, closure.blocksize) == (SM_COUNT, 64)
    assert closure.resolve_schedule_fn() is paged_mqa_schedule


# --- start-up compile -------------------------------------------------------------------------------


def test_building_an_indexer_compiles_the_kernel_on_a_cuda_device(hooked, torch_paged_mqa):
    warmed = []
    hooked.setattr(hook, "weights_device", lambda module: torch.device("cuda", 0))
    hooked.setattr(live, "is_warm", lambda device: False)
    hooked.setattr(live, "warm_up", warmed.append)
    build_indexer()
    assert warmed == [torch.device("cuda", 0)]


def test_a_failed_start_up_compile_is_logged_and_the_indexer_still_builds(
    hooked, torch_paged_mqa, caplog
):
    def broken(device):
        raise RuntimeError("no compiler")

    hooked.setattr(hook, "weights_device", lambda module: torch.device("cuda", 0))
    hooked.setattr(live, "is_warm", lambda device: False)
    hooked.setattr(live, "warm_up", broken)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        indexer = build_indexer()
    assert isinstance(indexer, dsa_indexer.Indexer)
    assert "no compiler" in caplog.text


def test_with_a_live_width_hook_sglang_left_unapplied_an_indexer_compiles_nothing(
    hooked, unapplied, torch_paged_mqa
):
    unapplied("deepgemm_paged_mqa_logits_split")
    hooked.setattr(hook, "weights_device", lambda module: torch.device("cuda", 0))
    hooked.setattr(live, "is_warm", lambda device: False)
    hooked.setattr(live, "warm_up", lambda device: pytest.fail("warm_up ran for no live copy"))
    build_indexer()


def test_an_indexer_built_on_the_cpu_compiles_nothing(hooked, torch_paged_mqa):
    hooked.setattr(live, "warm_up", lambda device: pytest.fail("warm_up ran without CUDA"))
    assert hook.weights_device(build_indexer()).type == "cpu"


def test_off_cuda_building_an_indexer_compiles_nothing(hooked, torch_paged_mqa, set_platform):
    set_platform(cuda=False, hip=True)
    hooked.setattr(hook, "weights_device", lambda module: torch.device("cuda", 0))
    hooked.setattr(live, "warm_up", lambda device: pytest.fail("warm_up ran off CUDA"))
    build_indexer()


# --- the facts docs/indexer-cliff.md maps (SGLang 0.5.23's own code) --------------------------------


@pytest.mark.parametrize("torch_logits", ["0", "1"], ids=["deepgemm", "torch-logits"])
@pytest.mark.parametrize("sm100", [False, True], ids=["sm90", "sm100"])
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_which_modes_pass_per_token_rows_to_the_split_path(monkeypatch, mode, sm100, torch_logits):
    """Per-token ``(rows, 1)`` context lengths everywhere but SM100 target verify with DeepGEMM's
    logits (``[B, next_n]``, the native path with requests as its batch); with
    ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1`` SM100 target verify takes the split path too."""
    monkeypatch.setattr(dsa_backend, "get_platform", lambda: SimpleNamespace(is_sm100=sm100))
    monkeypatch.setenv("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", torch_logits)
    bs, next_n = 3, 5
    seq = torch.tensor([10, 20, 30], dtype=torch.int32)
    ctx = DeepseekSparseAttnBackend._build_paged_mqa_schedule_2d_ctx_lens(
        SimpleNamespace(speculative_num_draft_tokens=next_n),
        mode,
        seq + next_n,
        torch.arange(bs * next_n, dtype=torch.int32),
        bs,
    )
    native = sm100 and mode.is_target_verify() and torch_logits == "0"
    assert tuple(ctx.shape) == ((bs, next_n) if native else (bs * next_n, 1))


def topk_layers(config) -> int:
    return sum(not dsa_layer_skips_topk(config, i) for i in range(config.num_hidden_layers))


def test_top_k_layers_of_deepseek_v32_and_glm5():
    """transformers' DeepSeek-V3.2 and GLM-5 configs (defaults: 61 and 78 layers, no top-k sharing):
    every layer computes top-k; with IndexShare's one indexer in four layers, 21 of 78."""
    deepseek = DeepseekV32Config(architectures=["DeepseekV32ForCausalLM"])
    glm5 = GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"])
    glm5_index_share = GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"], index_topk_freq=4)
    assert (deepseek.num_hidden_layers, topk_layers(deepseek)) == (61, 61)
    assert (glm5.num_hidden_layers, topk_layers(glm5)) == (78, 78)
    assert topk_layers(glm5_index_share) == 21
