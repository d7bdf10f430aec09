"""The one-launch MTP draft-decode replay, on SGLang's real multi-step backend class.

Step backends are real ``DeepseekSparseAttnBackend`` objects built without a model (``object.__new__``)
with CPU graph buffers, so the one launch runs through Triton's interpreter; the DeepGEMM schedule,
the top-k plan and ``set_dsa_prefill_impl`` are recorded instead of run.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_dsa_mtp.test.sglang_import import require_sglang

require_sglang()

import sglang.srt.layers.attention.dsa_backend as dsa_backend
from sglang.srt.layers.attention.dsa_backend import (
    DeepseekSparseAttnBackend,
    DeepseekSparseAttnMultiStepBackend,
    DSAFlashMLAMetadata,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsa_mtp import plugin
from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA
from sglang_dsa_mtp.test.dsa_backends import metadata_tensors as dsa_metadata_tensors
from sglang_dsa_mtp.test.dsa_backends import poison
from sglang_dsa_mtp.test.metadata_cases import POISON, make_case

WIDTH, PAGE, TOPK, MAX_BS = 300, 64, 200, 4


class StepBackend(DeepseekSparseAttnBackend):
    """A real DSA step backend without a model: graph buffers on the CPU, indexer refreshes recorded."""

    def __new__(cls, model_runner, **kwargs):
        self = object.__new__(cls)
        shared = model_runner.shared
        self.speculative_step_id = kwargs["speculative_step_id"]
        self.dsa_index_kpool = 1
        self.experimental_kpool_metadata_fusion = False
        self.physical_page_size = model_runner.page_size
        self.dsa_index_topk = TOPK
        self.dsa_decode_impl = "fa3"
        self.req_to_token = shared["req_to_token"]
        self.calls = []
        self.decode_cuda_graph_metadata = {}
        for bs in model_runner.captured_bs:
            rows = MAX_BS
            page_table = torch.full((rows, WIDTH), POISON, dtype=torch.int32)
            cache = torch.full((bs,), POISON, dtype=torch.int32)
            self.decode_cuda_graph_metadata[bs] = SimpleNamespace(
                cache_seqlens_int32=cache,
                cu_seqlens_k=torch.full((bs + 1,), POISON, dtype=torch.int32),
                page_table_1=page_table[:bs],
                dsa_cache_seqlens_int32=torch.full((bs,), POISON, dtype=torch.int32),
                dsa_cu_seqlens_k=torch.full((bs + 1,), POISON, dtype=torch.int32),
                real_page_table=(
                    torch.full((bs, -(-WIDTH // PAGE)), POISON, dtype=torch.int32)
                    if model_runner.page_size > 1
                    else page_table[:bs]
                ),
                paged_mqa_ctx_lens_2d=cache.view(-1, 1),
                flashmla_metadata=None,
            )
        return self

    def __init__(self, *args, **kwargs):
        pass

    def set_dsa_prefill_impl(self, forward_batch=None):
        self.calls.append("set_dsa_prefill_impl")

    def _refresh_paged_mqa_schedule_metadata(self, metadata, seqlens_32_2d):
        self.calls.append(("schedule", seqlens_32_2d.flatten().tolist()))

    def _refresh_topk_v2_plan(self, metadata):
        self.calls.append("topk_v2_plan")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.calls.append(("stock", in_capture))


def build_multi(hooked, *, steps, seeded, page_size=PAGE, captured_bs=(1, 3)):
    """A real DeepseekSparseAttnMultiStepBackend, built by its real (hooked) __init__."""
    hooked.setattr(dsa_backend, "DeepseekSparseAttnBackend", StepBackend)
    gen = torch.Generator().manual_seed(steps)
    runner = SimpleNamespace(
        page_size=page_size,
        captured_bs=captured_bs,
        shared={"req_to_token": torch.randint(0, 1 << 30, (8, WIDTH), generator=gen).int()},
    )
    return DeepseekSparseAttnMultiStepBackend(
        runner, 1, steps + 1, seed_dsa_topk_from_draft_extend=seeded
    )


def replay_batch(lengths, req_indices):
    return SimpleNamespace(
        batch_size=len(lengths),
        seq_lens=torch.tensor(lengths, dtype=torch.int64),
        req_pool_indices=torch.tensor(req_indices, dtype=torch.int64),
        seq_lens_cpu=None,
        forward_mode=ForwardMode.DECODE,
    )


def expected_buffers(multi, batch, page_size):
    """What SGLang's own decode kernel writes into one step's (identically poisoned) buffers."""
    case = make_case(
        "decode",
        batch.seq_lens.tolist(),
        req_indices=batch.req_pool_indices.tolist(),
        width=WIDTH,
        device="cpu",
        page_size=page_size,
        topk=TOPK,
        req_to_token=multi.attn_backends[0].req_to_token,
    )
    m = multi.attn_backends[0].decode_cuda_graph_metadata[batch.batch_size]
    out = {
        "cache_seqlens": torch.full_like(m.cache_seqlens_int32, POISON),
        "cu_seqlens_k": torch.full_like(m.cu_seqlens_k, POISON),
        "page_table_1": torch.full_like(m.page_table_1, POISON),
        "dsa_cache_seqlens": torch.full_like(m.dsa_cache_seqlens_int32, POISON),
        "dsa_cu_seqlens_k": torch.full_like(m.dsa_cu_seqlens_k, POISON),
        "real_page_table": torch.full_like(m.real_page_table, POISON) if page_size > 1 else None,
    }
    return case.run("sglang", out)


def step_buffers(m, page_size):
    return {
        "cache_seqlens": m.cache_seqlens_int32,
        "cu_seqlens_k": m.cu_seqlens_k,
        "page_table_1": m.page_table_1,
        "dsa_cache_seqlens": m.dsa_cache_seqlens_int32,
        "dsa_cu_seqlens_k": m.dsa_cu_seqlens_k,
        "real_page_table": m.real_page_table if page_size > 1 else None,
    }


def test_plugin_hooks_the_multi_step_backend():
    targets = {row.target for row in plugin.HOOKS if row.switch is BOUNDED_REPLAY_METADATA}
    owner = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"
    assert {f"{owner}.__init__", f"{owner}.init_forward_metadata_out_graph"} <= targets


@pytest.mark.parametrize("seeded", [True, False])
def test_the_seed_flag_is_kept_on_the_multi_step_backend(hooked, seeded):
    assert getattr(build_multi(hooked, steps=3, seeded=seeded), mtp.SEEDED) is seeded


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 64])
def test_one_launch_writes_what_sglangs_decode_kernel_writes_into_every_step(
    hooked, steps, page_size
):
    multi = build_multi(hooked, steps=steps, seeded=True, page_size=page_size)
    batch = replay_batch([129, 0, 300], [5, 2, 7])
    multi.init_forward_metadata_out_graph(batch)
    expected = expected_buffers(multi, batch, page_size)
    for i, backend in enumerate(multi.attn_backends):
        m = backend.decode_cuda_graph_metadata[3]
        for name, tensor in step_buffers(m, page_size).items():
            if tensor is not None:
                assert torch.equal(tensor, expected[name]), f"step {i}: {name}"
        assert backend.forward_metadata is m
        assert "set_dsa_prefill_impl" in backend.calls
        assert ("stock", False) not in backend.calls


def test_seeded_steps_skip_the_indexer_refreshes(hooked):
    multi = build_multi(hooked, steps=4, seeded=True)
    multi.init_forward_metadata_out_graph(replay_batch([129, 0, 300], [5, 2, 7]))
    for backend in multi.attn_backends:
        assert backend.calls == ["set_dsa_prefill_impl"]


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_unseeded_steps_get_the_plans_sglangs_per_step_refresh_computes(dsa_server, steps):
    """On SGLang's real multi-step backend, built, captured and replayed by SGLang (CPU stand-ins for
    DeepGEMM's schedule and the top-k plan, counted): the one launch computes the schedule and the
    plan once per replay and copies them into every step; a second backend on SGLang's own path
    (its per-step loop, which refreshes every step) ends with the same bits in every buffer."""
    server = dsa_server(num_steps=steps + 1)
    ours, stock = (server.multi_step(4, seeded=False) for _ in range(2))
    for multi in (ours, stock):
        server.capture(multi, ForwardMode.DECODE, [4])
    stock.__dict__[mtp.GATES][4] = "the reference arm runs SGLang's path"
    for lengths, slots in (([129, 0, 250, 64], [5, 2, 7, 1]), ([3, 299, 1, 200], [1, 3, 6, 4])):
        calls = []
        for multi in (ours, stock):
            for backend in multi.attn_backends:
                poison(backend.decode_cuda_graph_metadata[4], POISON)
            before = dict(server.calls)
            server.replay(multi, ForwardMode.DECODE, lengths, slots)
            calls.append({k: v - before.get(k, 0) for k, v in server.calls.items()})
        assert calls[0] == {"schedule": 1, "topk_plan": 1}
        assert calls[1] == {"schedule": steps, "topk_plan": steps}
        for i, (a, b) in enumerate(zip(ours.attn_backends, stock.attn_backends)):
            got = dsa_metadata_tensors(a.decode_cuda_graph_metadata[4])
            want = dsa_metadata_tensors(b.decode_cuda_graph_metadata[4])
            for name in ("paged_mqa_schedule_metadata", "topk_v2_plan", "paged_mqa_ctx_lens_2d"):
                assert torch.equal(got[name], want[name]), f"step {i}: {name}"
            assert a.forward_metadata is a.decode_cuda_graph_metadata[4]


def test_capture_runs_sglang_and_decides_the_gate_per_bs(hooked, caplog):
    multi = build_multi(hooked, steps=3, seeded=True, captured_bs=(1, 3))
    # bs 3 of step 2 gets a table of another width: that bs keeps the stock path, bs 1 does not.
    m = multi.attn_backends[2].decode_cuda_graph_metadata[3]
    m.page_table_1 = torch.full((3, WIDTH - 1), POISON, dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        for bs in (1, 3):
            batch = replay_batch([10] * bs, list(range(bs)))
            batch.input_ids = batch.positions = batch.spec_info = None
            batch.seq_lens_sum = 10 * bs
            multi.init_forward_metadata_out_graph(batch, in_capture=True)
    gates = getattr(multi, mtp.GATES)
    assert gates[1] is None
    assert "step backend 2's page_table_1" in gates[3]
    assert "bs 3 keeps SGLang's precompute + copies" in caplog.text
    for backend in multi.attn_backends:
        assert backend.calls.count(("stock", True)) == 2


@pytest.mark.parametrize(
    "breakage,reason",
    [
        (lambda multi, hooked, set_platform: set_platform(cuda=False, hip=True), "HIP"),
        (lambda multi, hooked, set_platform: set_platform(cuda=False, hip=False), "not a CUDA"),
        (
            lambda multi, hooked, set_platform: hooked.setenv(BOUNDED_REPLAY_METADATA.env, "0"),
            "SGLANG_DSA_BOUNDED_REPLAY_METADATA=0",
        ),
        (
            lambda multi, hooked, set_platform: setattr(
                multi.attn_backends[1], "dsa_index_kpool", 4
            ),
            "dsa_index_kpool 4",
        ),
        (
            lambda multi, hooked, set_platform: setattr(
                multi.attn_backends[0], "experimental_kpool_metadata_fusion", True
            ),
            "KPool metadata fusion",
        ),
        (
            lambda multi, hooked, set_platform: multi.attn_backends.append(multi.attn_backends[0]),
            "5 step backends",
        ),
        (
            lambda multi, hooked, set_platform: setattr(
                multi.attn_backends[3].decode_cuda_graph_metadata[3], "real_page_table", None
            ),
            "lacks real_page_table",
        ),
    ],
    ids=["hip", "not-cuda", "switch-off", "kpool-4", "fusion", "five-steps", "mismatched-tables"],
)
def test_gate_keeps_the_stock_path(hooked, set_platform, breakage, reason):
    multi = build_multi(hooked, steps=4, seeded=True)
    breakage(multi, hooked, set_platform)
    assert reason in mtp.why_not_one_launch(multi, 3)
    stock = []
    mtp.one_launch_out_graph(
        lambda self, fb, in_capture=False: stock.append(fb.batch_size),
        multi,
        replay_batch([1, 2, 3], [0, 1, 2]),
    )
    assert stock == [3]
    for backend in multi.attn_backends:
        assert "set_dsa_prefill_impl" not in backend.calls


def test_a_failing_one_launch_falls_back_to_sglang_for_that_bs(hooked, caplog):
    multi = build_multi(hooked, steps=2, seeded=True)
    multi.attn_backends[1].decode_cuda_graph_metadata[3].cu_seqlens_k = None  # breaks the launch
    stock = []
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        for _ in range(2):
            mtp.one_launch_out_graph(
                lambda self, fb, in_capture=False: stock.append(fb.batch_size),
                multi,
                replay_batch([1, 2, 3], [0, 1, 2]),
            )
    assert stock == [3, 3]
    assert "one launch raised" in getattr(multi, mtp.GATES)[3]
    assert caplog.text.count("falls back to SGLang's path") == 1


def test_flashmla_tile_metadata_is_computed_once_and_copied_into_every_step(hooked):
    """``flashmla_kv`` decode: computed from step 0's clipped lengths (seq_len_q 1), as stock does
    from its scratch, then copied into each step's buffers (num_splits[:bs + 1], whole tile data).
    """
    multi = build_multi(hooked, steps=3, seeded=True)
    computed = []

    def compute(cache_seqlens, seq_len_q):
        computed.append((cache_seqlens.tolist(), seq_len_q))
        return DSAFlashMLAMetadata(
            flashmla_metadata=torch.arange(8, dtype=torch.int32).view(2, 4),
            num_splits=torch.tensor([0, 2, 5, 9], dtype=torch.int32),
        )

    for backend in multi.attn_backends:
        backend.dsa_decode_impl = "flashmla_kv"
        backend._compute_flashmla_metadata = compute
        backend.decode_cuda_graph_metadata[3].flashmla_metadata = DSAFlashMLAMetadata(
            flashmla_metadata=torch.full((2, 4), POISON, dtype=torch.int32),
            num_splits=torch.full((6,), POISON, dtype=torch.int32),
        )
    multi.init_forward_metadata_out_graph(replay_batch([129, 0, 300], [5, 2, 7]))
    assert computed == [([129, 0, 200], 1)]  # min(seq, topk 200)
    for backend in multi.attn_backends:
        m = backend.decode_cuda_graph_metadata[3].flashmla_metadata
        assert m.flashmla_metadata.flatten().tolist() == list(range(8))
        assert m.num_splits.tolist() == [0, 2, 5, 9, POISON, POISON]
