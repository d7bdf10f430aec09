"""No wide page_table_1 where nothing reads it, one real_page_table per backend, on SGLang's real DSA
backends.

The backends are built by SGLang's own constructors (the target through its attention registry, the
draft-extend and multi-step backends through its ``DraftBackendFactory``) in a published EAGLE launch,
get their graph state from SGLang's ``init_cuda_graph_state``, and are captured and replayed through
SGLang's own graph entry points, on the CPU (``support.dsa_backends``). Each comparison
builds the same server twice, ``SGLANG_DSA_LIVE_WIDTH`` on and off, replays the same rounds, and
compares what SGLang's kernels read from every captured batch size's metadata.
"""

import logging

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_spec

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.integration import dsa_graph_page_tables as page_tables
from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
from sglang_dsa_mtp.integration.state import BackendState, MultiStepState, peek
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, LIVE_WIDTH
from support import dsa_backends as kit
from support.metadata_cases import kernel_for

CONTEXT = 300  # page tables 309 columns wide at EAGLE 4/1/5 (5 pages of 64)
MAX_BS = 4
CAPTURED = (4, 3, 1)  # SGLang captures the largest batch size first
VERIFY, EXTEND, DECODE = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.DECODE


@pytest.fixture
def server(hooked):
    """SGLang's plugin loader has applied our hooks; SGLang's CUDA-only pieces have CPU stand-ins."""
    kit.cuda_stand_ins(hooked)
    return hooked


def graph_state(*, seeded=True, hisparse=None, page_size=64, hf_config=None):
    """Target, draft-extend and multi-step backends of the published launch, with SGLang's graph
    state and every captured batch size's metadata, over one shared random req_to_token."""
    tokens = get_spec().speculative_num_draft_tokens
    generator = torch.Generator().manual_seed(7)
    req_to_token = torch.randint(
        0, 1 << 20, (8, CONTEXT + 4 + tokens), generator=generator, dtype=torch.int32
    )
    common = dict(
        context_len=CONTEXT,
        page_size=page_size,
        req_to_token=req_to_token,
        hisparse_coordinator=hisparse,
        hf_config=hf_config,
    )
    target = kit.target_backend(kit.model_runner(**common))
    extend, multi = kit.draft_backends(kit.model_runner(is_draft=True, **common), seeded=seeded)
    target.init_cuda_graph_state(MAX_BS, MAX_BS * tokens)
    extend.init_cuda_graph_state(MAX_BS, MAX_BS * tokens)
    multi.init_cuda_graph_state(MAX_BS, MAX_BS)
    for bs in CAPTURED:
        kit.capture(target, bs, VERIFY)
        kit.capture(extend, bs, EXTEND)
        kit.capture(multi, bs, DECODE)
    return target, extend, multi


def backends(state):
    target, extend, multi = state
    return [("target", target), ("draft extend", extend)] + [
        (f"draft step {i}", step) for i, step in enumerate(multi.attn_backends)
    ]


# Rounds of (seq_lens, req_pool_indices): lengths 0, 1, around a page (64) and a 128-column block,
# and up to the widest a verify may reach (seq + 5 draft tokens = the 309-column width).
ROUNDS = (
    ([129, 0, 304], [5, 2, 7]),
    ([63, 64, 65, 1], [1, 3, 0, 6]),
    ([200],),
    ([1, 127, 128], [7, 7, 4]),
)


def replay_rounds(state):
    """Replay every round through every backend; what SGLang's kernels read after each."""
    target, extend, multi = state
    seen = []
    for round_ in ROUNDS:
        lengths = round_[0]
        requests = round_[1] if len(round_) > 1 else [3] * len(lengths)
        kit.replay(target, VERIFY, lengths, requests)
        kit.replay(extend, EXTEND, [n + 5 for n in lengths], requests)
        kit.replay(multi, DECODE, lengths, requests)
        bs = len(lengths)
        seen.append(
            {
                name: kit.read_buffers(backend.decode_cuda_graph_metadata[bs])
                for name, backend in backends(state)
            }
        )
    return seen


def assert_same_reads(ours, stock):
    for round_, (a, b) in enumerate(zip(ours, stock)):
        for backend in b:
            expected = {k: v for k, v in b[backend].items() if not k.startswith("page_table_1")}
            got = {k: v for k, v in a[backend].items() if not k.startswith("page_table_1")}
            assert got.keys() == expected.keys(), f"round {round_}, {backend}"
            for name in expected:
                same = (
                    torch.equal(got[name], expected[name])
                    if isinstance(expected[name], torch.Tensor)
                    else got[name] == expected[name]
                )
                assert same, f"round {round_}, {backend}: {name}"


def both_arms(server, **state_kwargs):
    """(live width on, live width off): the same server built and replayed twice."""
    server.setenv(LIVE_WIDTH.env, "1")
    on = graph_state(**state_kwargs)
    ours = replay_rounds(on)
    server.setenv(LIVE_WIDTH.env, "0")
    off = graph_state(**state_kwargs)
    return on, ours, off, replay_rounds(off)


def real_table_width(backend):
    return -(-backend.req_to_token.shape[1] // backend.physical_page_size)


# --- the plugin's rows ------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_live_width_switch_hooks_the_graph_state_of_both_dsa_backend_classes():
    targets = {row.target for row in hooks.rows_of(LIVE_WIDTH)}
    dsa = "sglang.srt.layers.attention.dsa_backend"
    assert {
        f"{dsa}.DeepseekSparseAttnBackend.init_cuda_graph_state",
        f"{dsa}.DeepseekSparseAttnBackend._init_kpool_metadata_capture",
        f"{dsa}.DeepseekSparseAttnMultiStepBackend.init_cuda_graph_state",
        f"{dsa}.DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph",
    } <= targets


# --- item 3: no wide table where nothing reads it ---------------------------------------------------


@pytest.mark.parametrize("launch", ["4/1/5", "5/1/6"])
def test_spec_backends_drop_the_wide_table_as_sglang_does_outside_spec_mode(server, launch):
    with kit.serving(launch):
        state = graph_state()
        tokens = get_spec().speculative_num_draft_tokens
        for name, backend in backends(state):
            assert backend.dsa_drop_wide_page_table, name
            assert backend.speculative_num_draft_tokens == tokens, f"{name}: restored"
            graph = backend.decode_cuda_graph_metadata
            assert graph["page_table"] is None, name
            shared = graph["real_page_table"]
            assert shared.shape[1] == real_table_width(backend), name
            for bs in CAPTURED:
                assert graph[bs].page_table_1 is None, f"{name} bs {bs}"
                assert graph[bs].real_page_table._base is shared, f"{name} bs {bs}"
            assert peek(backend, BackendState).shared_real_page_table is None, name
        assert peek(state[2], MultiStepState).steps_dropped


def test_the_switch_off_keeps_sglangs_spec_graph_state(server):
    server.setenv(LIVE_WIDTH.env, "0")
    with kit.serving():
        for name, backend in backends(graph_state()):
            graph = backend.decode_cuda_graph_metadata
            assert not backend.dsa_drop_wide_page_table, name
            assert graph["page_table"].shape[1] == backend.req_to_token.shape[1], name
            reals = [graph[bs].real_page_table for bs in CAPTURED]
            assert all(table._base is None for table in reals), f"{name}: one table per bs"


@pytest.mark.parametrize("kernels", ["bounded", "sglang"])
def test_replays_without_the_wide_table_give_sglangs_kernels_the_same_metadata(server, kernels):
    """Target verify, draft extend and every draft step (the one launch with the bounded kernels;
    SGLang's precompute + copies with SGLang's kernels, where the steps keep their tables)."""
    if kernels == "sglang":
        server.setenv(BOUNDED_REPLAY_METADATA.env, "0")
        for op, name in (
            ("decode", "fused_dsa_decode_metadata"),
            ("verify", "fused_dsa_target_verify_metadata"),
            ("draft_extend", "fused_dsa_draft_extend_metadata"),
        ):
            server.setattr(manager, name, kernel_for(op, "sglang"))
    with kit.serving():
        on, ours, _, stock = both_arms(server)
    assert on[0].dsa_drop_wide_page_table and on[1].dsa_drop_wide_page_table
    steps_dropped = kernels == "bounded"
    assert all(b.dsa_drop_wide_page_table == steps_dropped for b in on[2].attn_backends)
    assert_same_reads(ours, stock)


@pytest.mark.parametrize(
    "launch,server_args,why",
    [
        ((6, 1, 7), {}, "5 step backends"),
        ("4/1/5", {"env": (BOUNDED_REPLAY_METADATA.env, "0")}, "BOUNDED_REPLAY_METADATA=0"),
    ],
    ids=["five-step-backends", "one-launch-switched-off"],
)
def test_step_backends_keep_the_table_for_sglangs_draft_decode_precompute(
    server, launch, server_args, why
):
    if "env" in server_args:
        server.setenv(*server_args["env"])
    with kit.serving(launch):
        target, extend, multi = graph_state()
    assert target.dsa_drop_wide_page_table and extend.dsa_drop_wide_page_table
    for step in multi.attn_backends:
        assert not step.dsa_drop_wide_page_table
        assert why in peek(step, BackendState).step_reader
    assert not peek(multi, MultiStepState).steps_dropped


def test_step_backends_keep_the_table_when_sglang_did_not_apply_the_one_launch_hook(
    server, unapplied
):
    why = unapplied("DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph")
    with kit.serving():
        _, _, multi = graph_state()
    assert not any(step.dsa_drop_wide_page_table for step in multi.attn_backends)
    assert why in peek(multi.attn_backends[0], BackendState).step_reader


def test_a_step_batch_size_the_one_launch_declines_replays_each_step_backend(server, caplog):
    """Unseeded steps (every step refreshes its indexer plans on both paths)."""
    server.setattr(mtp, "_tables_mismatch", lambda metas, backends: "declined for the test")
    with kit.serving(), caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        on, ours, _, stock = both_arms(server, seeded=False)
    assert all(step.dsa_drop_wide_page_table for step in on[2].attn_backends)
    assert_same_reads(ours, stock)
    assert (
        "replays each step backend's own metadata (the step backends have no page_table_1): "
        "declined for the test"
    ) in caplog.text


def test_a_failing_one_launch_replays_each_step_backend_and_never_raises(server, caplog):
    """Unseeded steps (every step refreshes its indexer plans on both paths)."""
    write = mtp.write_draft_decode_metadata

    def broken(multi, forward_batch, plan):
        raise RuntimeError("broken for the test")

    with kit.serving(), caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        server.setattr(mtp, "write_draft_decode_metadata", broken)
        on = graph_state(seeded=False)
        ours = replay_rounds(on) + replay_rounds(on)
        server.setattr(mtp, "write_draft_decode_metadata", write)
        server.setenv(LIVE_WIDTH.env, "0")
        off = graph_state(seeded=False)
        stock = replay_rounds(off) + replay_rounds(off)
    assert all(step.dsa_drop_wide_page_table for step in on[2].attn_backends)
    assert_same_reads(ours, stock)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"sglang_dsa_mtp: MTP draft-decode metadata for bs {bs} replays each step backend's own "
        "metadata (the step backends have no page_table_1) from now on: the one launch raised: "
        "RuntimeError: broken for the test"
        for bs in dict.fromkeys(len(round_[0]) for round_ in ROUNDS)
    ], "one accurate line per batch size, then straight to each step's replay"


# --- readers keep the wide table, and then get one real_page_table per backend ----------------------

READERS = {
    "unfused-topk": dict(env=("SGLANG_DSA_FUSE_TOPK", "0")),
    "no-topk-v2": dict(env=("SGLANG_OPT_USE_TOPK_V2", "0")),
    "flashinfer-topk": dict(
        args=dict(dsa_topk_backend="flashinfer", speculative_dsa_topk_backend="flashinfer"),
        env=("SGLANG_OPT_USE_TOPK_V2", "1"),
    ),
    "hisparse": dict(state=dict(hisparse=object())),
    "kpool-4": dict(state=dict(hf_config=kit.glm5_config(index_kpool=4))),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_sglang_knows_keeps_the_wide_table(server, reader):
    case = READERS[reader]
    if "env" in case:
        server.setenv(*case["env"])
    with kit.serving(**case.get("args", {})):
        state = graph_state(**case.get("state", {}))
    for name, backend in backends(state):
        assert not backend.dsa_drop_wide_page_table, name
        assert backend.decode_cuda_graph_metadata["page_table"] is not None, name


def test_page_size_1_keeps_the_table_that_is_its_only_page_table(server):
    with kit.serving():
        state = graph_state(page_size=1)
    for name, backend in backends(state):
        graph = backend.decode_cuda_graph_metadata
        assert not backend.dsa_drop_wide_page_table, name
        assert graph[1].real_page_table is graph[1].page_table_1, name
        assert peek(backend, BackendState).shared_real_page_table is None, name


@pytest.mark.parametrize("reader", ["unfused-topk", "kpool-4"])
def test_a_kept_wide_table_shares_one_real_page_table_per_backend(server, reader):
    case = READERS[reader]
    if "env" in case:
        server.setenv(*case["env"])
    with kit.serving():
        state = graph_state(**case.get("state", {}))
    tokens = 5
    for name, backend in backends(state):
        shared = peek(backend, BackendState).shared_real_page_table
        rows = MAX_BS * (1 if name.startswith("draft step") else tokens)
        assert shared.shape == (rows, real_table_width(backend)), name
        for bs in CAPTURED:
            assert backend.decode_cuda_graph_metadata[bs].real_page_table._base is shared, name


def test_the_shared_real_page_table_gives_sglangs_kernels_the_same_metadata(server):
    """With the wide table kept (top-k without v2), over replays of every captured batch size."""
    server.setenv("SGLANG_OPT_USE_TOPK_V2", "0")
    with kit.serving():
        on, ours, _, stock = both_arms(server)
    assert all(peek(b, BackendState).shared_real_page_table is not None for _, b in backends(on))
    assert_same_reads(ours, stock)


def test_the_shared_real_page_table_matches_the_wide_table_it_is_derived_from(server):
    """After any sequence of replays each captured bs's compact table is the page-start column of
    the wide table (one buffer for all bs) on every column, as it is in SGLang's drop branch."""
    server.setenv("SGLANG_OPT_USE_TOPK_V2", "0")
    with kit.serving():
        state = graph_state()
        replay_rounds(state)
    for name, backend in backends(state):
        for bs in CAPTURED:
            m = backend.decode_cuda_graph_metadata[bs]
            derived = backend._transform_table_1_to_real(m.page_table_1)
            assert torch.equal(m.real_page_table, derived), f"{name} bs {bs}"


def test_not_cuda_keeps_sglangs_graph_state(server, set_platform):
    set_platform(cuda=False, hip=True)
    with kit.serving():
        state = graph_state()
    for name, backend in backends(state):
        assert not backend.dsa_drop_wide_page_table, name
        assert peek(backend, BackendState).shared_real_page_table is None, name


def test_a_live_width_hook_sglang_left_unapplied_keeps_sglangs_graph_state(
    server, unapplied, caplog
):
    """Without the capture hook, for one, a shared real_page_table would be allocated and unused."""
    why = unapplied("DeepseekSparseAttnBackend._init_kpool_metadata_capture")
    with kit.serving(), caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        state = graph_state()
    for name, backend in backends(state):
        assert not backend.dsa_drop_wide_page_table, name
        assert peek(backend, BackendState).shared_real_page_table is None, name
    assert f"keeps its wide page_table_1: {why}" in caplog.text


@pytest.mark.parametrize(
    "gate,keeps,steps_only",
    [
        ("why_keep_wide_table", "a DSA backend keeps SGLang's spec-mode graph page tables", False),
        (
            "why_steps_keep_wide_table",
            "the MTP draft step backends keep their wide page_table_1",
            True,
        ),
    ],
    ids=["backend-gate", "steps-gate"],
)
def test_a_gate_that_raises_keeps_the_wide_tables_with_one_error(
    server, caplog, gate, keeps, steps_only
):
    def raising(backend):
        raise RuntimeError("injected failure")

    server.setattr(page_tables, gate, raising)
    with kit.serving(), caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        state = graph_state()
    for name, backend in backends(state):
        assert backend.dsa_drop_wide_page_table == (steps_only and "step" not in name), name
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"sglang_dsa_mtp: {keeps}: the gate raised: RuntimeError: injected failure"
    ]


def test_without_speculative_decoding_sglang_decides_alone(server):
    runner_args = dict(context_len=CONTEXT)
    with kit.serving(None):
        server.setenv(LIVE_WIDTH.env, "1")
        on = kit.target_backend(kit.model_runner(**runner_args))
        on.init_cuda_graph_state(MAX_BS, MAX_BS)
        server.setenv(LIVE_WIDTH.env, "0")
        off = kit.target_backend(kit.model_runner(**runner_args))
        off.init_cuda_graph_state(MAX_BS, MAX_BS)
    assert on.dsa_drop_wide_page_table and off.dsa_drop_wide_page_table


def test_an_error_in_sglangs_drop_branch_runs_its_spec_allocation_and_restores_the_spec_flag(
    server, caplog
):
    calls, stand_in = [], DeepseekSparseAttnBackend._compute_flashmla_metadata

    def flaky(self, cache_seqlens, seq_len_q):
        calls.append(self.speculative_num_draft_tokens)
        if len(calls) == 1:
            raise RuntimeError("flaky for the test")
        return stand_in(self, cache_seqlens, seq_len_q)

    server.setattr(DeepseekSparseAttnBackend, "_compute_flashmla_metadata", flaky)
    with kit.serving(), caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        target = kit.target_backend(kit.model_runner(context_len=CONTEXT))
        target.init_cuda_graph_state(MAX_BS, MAX_BS * 5)
    assert calls == [0, 5], "first with the spec clause lifted, then SGLang's spec allocation"
    assert target.speculative_num_draft_tokens == 5
    assert not target.dsa_drop_wide_page_table
    assert "keeps SGLang's wide page_table_1: RuntimeError: flaky for the test" in caplog.text


# --- memory -------------------------------------------------------------------------------------------


def test_graph_state_bytes_drop_by_the_wide_table_and_the_per_bs_compact_tables(server):
    def state_bytes(switch):
        server.setenv(LIVE_WIDTH.env, switch)
        return [kit.graph_state_bytes(b) for _, b in backends(graph_state())]

    with kit.serving():
        on, off = state_bytes("1"), state_bytes("0")
    width, real = CONTEXT + 4 + 5, -(-(CONTEXT + 4 + 5) // 64)
    verify_mask = MAX_BS * 5 * 5  # the target's QLEN_ONLY mask: max bs x draft tokens^2 bools
    for i, rows_per_req in enumerate([5, 5, 1, 1, 1]):
        wide = MAX_BS * rows_per_req * width * 4
        per_bs = sum(bs * rows_per_req * real * 4 for bs in CAPTURED)
        shared = MAX_BS * rows_per_req * real * 4
        added = shared + (verify_mask if i == 0 else 0)
        assert off[i] - on[i] == wide + per_bs - added, f"backend {i}"
