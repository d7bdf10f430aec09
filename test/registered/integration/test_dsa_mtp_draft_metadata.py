"""The MTP draft-decode replay hook, on SGLang's real multi-step backend and step backends.

The backends come from SGLang's ``DraftBackendFactory`` in a published EAGLE launch, get their graph
state from SGLang's ``init_cuda_graph_state`` and are captured and replayed through SGLang's own
entry points on the CPU (``support.dsa_backends.CpuDsaServer``: stand-ins, counted,
for DeepGEMM's schedule, the top-k v2 plan and FlashMLA's tile metadata). Each replay's buffers are
poisoned first, and compared whole with what SGLang's own code writes.
"""

import logging

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
from sglang_dsa_mtp.integration.state import MultiStepState, state_of
from sglang_dsa_mtp.kernels.ops.launch import TRITON_LAUNCH
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, LIVE_WIDTH, METADATA_GLUE
from support.constants import POISON
from support.dsa_backends import graph_batch, metadata_tensors, poison
from support.launch_stubs import compiled_on_cpu
from support.metadata_cases import kernel_for

DECODE = ForwardMode.DECODE
BS = 3
ROUNDS = (([129, 0, 295], [5, 2, 7]), ([1, 128, 64], [3, 3, 1]), ([0, 0, 0], [1, 2, 3]))
OWNER = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnMultiStepBackend"


@pytest.fixture
def spies(hooked):
    """Every launch of the one launch, every call of SGLang's precompute, every step's prefill-impl
    reset, counted per kind."""
    seen = {"one launch": 0, "precompute": 0, "set_dsa_prefill_impl": 0}

    def counting(kind, fn):
        def call(*args, **kwargs):
            seen[kind] += 1
            return fn(*args, **kwargs)

        return call

    hooked.setattr(
        mtp,
        "fused_dsa_draft_decode_metadata_multi",
        counting("one launch", mtp.fused_dsa_draft_decode_metadata_multi),
    )
    for name, kind in (
        ("_precompute_replay_metadata", "precompute"),
        ("set_dsa_prefill_impl", "set_dsa_prefill_impl"),
    ):
        hooked.setattr(
            DeepseekSparseAttnBackend,
            name,
            counting(kind, getattr(DeepseekSparseAttnBackend, name)),
        )
    return seen


@pytest.fixture
def launches(hooked):
    """Every launch of the replay-metadata kernels, ``(kind, op)`` (kind "jit": the wrapper's,
    "bound": a bound launch's), with compiled kernels stood in for on the CPU
    (``support.launch_stubs``): the one launch's capture binds its launch as on a GPU."""
    recorded = []
    compiled_on_cpu(hooked, recorded)
    return recorded


ONE_LAUNCH = mtp.ONE_LAUNCH_BINDER.what


def build(dsa_server, *, steps=4, seeded=True, captured=(1, BS), **options):
    """A server and its MTP draft-decode backend with ``steps`` step backends, captured."""
    server = dsa_server(num_steps=steps + 1, **options)
    multi = server.multi_step(max(captured), seeded=seeded)
    server.capture(multi, DECODE, captured)
    return server, multi


def sglang_decode(backend, metadata, lengths, slots) -> dict:
    """What SGLang's own decode kernel writes into poisoned copies of one step's buffers."""
    out = {
        "cache_seqlens": metadata.cache_seqlens_int32,
        "cu_seqlens_k": metadata.cu_seqlens_k,
        "page_table_1": metadata.page_table_1,
        "dsa_cache_seqlens": metadata.dsa_cache_seqlens_int32,
        "dsa_cu_seqlens_k": metadata.dsa_cu_seqlens_k,
        "real_page_table": metadata.real_page_table if backend.physical_page_size > 1 else None,
    }
    out = {name: None if t is None else torch.full_like(t, POISON) for name, t in out.items()}
    kernel_for("decode", "sglang")(
        seq_lens=torch.tensor(lengths, dtype=torch.int64),
        req_pool_indices=torch.tensor(slots, dtype=torch.int64),
        req_to_token=backend.req_to_token,
        bs=len(lengths),
        max_len=backend._graph_page_table_width(metadata),
        dsa_index_topk=backend.dsa_index_topk,
        physical_page_size=backend.physical_page_size,
        **out,
    )
    return {
        "cache_seqlens_int32": out["cache_seqlens"],
        "cu_seqlens_k": out["cu_seqlens_k"],
        "page_table_1": out["page_table_1"],
        "dsa_cache_seqlens_int32": out["dsa_cache_seqlens"],
        "dsa_cu_seqlens_k": out["dsa_cu_seqlens_k"],
        "real_page_table": out["real_page_table"],
    }


@pytest.mark.quick
def test_plugin_hooks_the_multi_step_backend_once_per_target():
    rows = [row for row in hooks.HOOKS if row.target.startswith(f"{OWNER}.")]
    assert {row.target for row in hooks.rows_of(BOUNDED_REPLAY_METADATA)} >= {
        f"{OWNER}.__init__",
        f"{OWNER}.init_forward_metadata_out_graph",
        f"{OWNER}.init_cuda_graph_state",
    }
    assert len({row.target for row in rows}) == len(rows)
    switches = {
        "init_forward_metadata_out_graph": {BOUNDED_REPLAY_METADATA, LIVE_WIDTH, METADATA_GLUE},
        "init_cuda_graph_state": {BOUNDED_REPLAY_METADATA, LIVE_WIDTH, METADATA_GLUE},
    }
    for method, expected in switches.items():
        [row] = [row for row in rows if row.target == f"{OWNER}.{method}"]
        assert set(row.switches) == expected, method


def test_a_new_graph_state_drops_the_plans_made_on_the_old_one(dsa_server, hooked, spies):
    """SGLang builds the step backends' graph state again: the plans of the batch sizes captured
    before point at the old buffers. Each batch size is decided again at its next capture; one that
    is not captured again takes SGLang's path."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    server, multi = build(dsa_server, captured=(1, BS))
    state = state_of(multi, MultiStepState)
    assert sorted(state.batch_sizes) == [1, BS]
    multi.init_cuda_graph_state(BS, BS)
    assert state.batch_sizes == {}
    server.capture(multi, DECODE, [BS])
    assert sorted(state.batch_sizes) == [BS]
    for backend, metadata in zip(multi.attn_backends, state.batch_sizes[BS].metadata):
        assert metadata is backend.decode_cuda_graph_metadata[BS]
    launched, stock = spies["one launch"], []
    batch = graph_batch(1, DECODE, seq_lens=[5], req_pool_indices=[2])
    mtp.draft_decode_metadata(
        lambda self, fb, in_capture=False: stock.append(fb.batch_size), multi, batch
    )
    assert stock == [1] and spies["one launch"] == launched


@pytest.mark.parametrize("seeded", [True, False])
def test_the_seed_flag_is_kept_on_the_multi_step_backend(dsa_server, seeded):
    _, multi = build(dsa_server, seeded=seeded)
    assert state_of(multi, MultiStepState).seeded is seeded


@pytest.mark.parametrize("live_width", ["1", "0"], ids=["tables-dropped", "tables-kept"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 64])
def test_one_launch_writes_what_sglangs_decode_kernel_writes_into_every_step(
    dsa_server, hooked, spies, steps, page_size, live_width
):
    hooked.setenv(LIVE_WIDTH.env, live_width)
    server, multi = build(dsa_server, steps=steps, page_size=page_size)
    assert state_of(multi, MultiStepState).batch_sizes[BS].reason is None
    for lengths, slots in ROUNDS:
        for backend in multi.attn_backends:
            poison(backend.decode_cuda_graph_metadata[BS], POISON)
        before = dict(spies)
        server.replay(multi, DECODE, lengths, slots)
        assert spies["one launch"] - before["one launch"] == 1
        assert spies["precompute"] == before["precompute"]
        assert spies["set_dsa_prefill_impl"] - before["set_dsa_prefill_impl"] == steps
        for i, backend in enumerate(multi.attn_backends):
            m = backend.decode_cuda_graph_metadata[BS]
            expected = sglang_decode(backend, m, lengths, slots)
            for name, want in expected.items():
                if want is not None:
                    assert torch.equal(getattr(m, name), want), f"step {i}: {name}"
            assert backend.forward_metadata is m


def assert_every_step_holds_what_sglang_writes(multi, lengths, slots, what: str) -> None:
    for i, backend in enumerate(multi.attn_backends):
        m = backend.decode_cuda_graph_metadata[BS]
        for name, want in sglang_decode(backend, m, lengths, slots).items():
            if want is not None:
                assert torch.equal(getattr(m, name), want), f"{what}, step {i}: {name}"
        assert backend.forward_metadata is m


def replay_poisoned(server, multi, spies, launches, lengths, slots) -> dict:
    """One replay of ``BS`` with every step backend's buffers poisoned and the launch record emptied
    first; the spies' counts before it."""
    for backend in multi.attn_backends:
        poison(backend.decode_cuda_graph_metadata[BS], POISON)
    before = dict(spies)
    launches.clear()
    server.replay(multi, DECODE, lengths, slots)
    return before


def test_a_replay_the_bound_one_launch_takes_writes_sglangs_metadata_without_the_wrapper(
    dsa_server, hooked, spies, launches
):
    """The launch bound at the capture of the bs launches each replay; the wrapper (Triton's JIT)
    runs no second launch over it."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    server, multi = build(dsa_server, steps=4)
    plan = state_of(multi, MultiStepState).batch_sizes[BS]
    assert plan.reason is None and plan.bound.launcher == TRITON_LAUNCH
    for round_, (lengths, slots) in enumerate(ROUNDS):
        before = replay_poisoned(server, multi, spies, launches, lengths, slots)
        assert launches == [("bound", ONE_LAUNCH)], f"round {round_}"
        assert spies["one launch"] == before["one launch"], f"round {round_}: the wrapper ran"
        assert spies["precompute"] == before["precompute"]
        assert_every_step_holds_what_sglang_writes(multi, lengths, slots, f"round {round_}")


def test_a_replay_the_bound_one_launch_refuses_goes_through_the_wrapper_once(
    dsa_server, hooked, spies, launches
):
    """The bs's plan holds a launch bound with other arguments (bs 1's, a real bound launch): it is
    asked, refuses, and the wrapper launches the replay, once, writing what SGLang writes."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    server, multi = build(dsa_server, steps=4, captured=(1, BS))
    plans = state_of(multi, MultiStepState).batch_sizes
    other = plans[1].bound
    assert plans[BS].reason is None and other is not None
    answers = []

    def asked(kwargs):
        answers.append(other(kwargs))
        return answers[-1]

    hooked.setattr(plans[BS], "bound", asked)
    for round_, (lengths, slots) in enumerate(ROUNDS):
        before = replay_poisoned(server, multi, spies, launches, lengths, slots)
        assert answers == [False] * (round_ + 1), f"round {round_}: the bound launch not asked"
        assert launches == [("jit", ONE_LAUNCH)], f"round {round_}"
        assert spies["one launch"] - before["one launch"] == 1, f"round {round_}"
        assert spies["precompute"] == before["precompute"]
        assert_every_step_holds_what_sglang_writes(multi, lengths, slots, f"round {round_}")


@pytest.mark.quick
def test_seeded_steps_skip_the_indexer_refreshes(dsa_server):
    server, multi = build(dsa_server, seeded=True)
    before = dict(server.calls)
    server.replay(multi, DECODE, *ROUNDS[0])
    assert {k: server.calls[k] - before.get(k, 0) for k in ("schedule", "topk_plan")} == {
        "schedule": 0,
        "topk_plan": 0,
    }


def stock_arm(multi) -> None:
    """Send every captured batch size of ``multi`` to the path SGLang's own code takes."""
    for plan in state_of(multi, MultiStepState).batch_sizes.values():
        plan.reason = "the reference arm runs SGLang's path"


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_unseeded_steps_get_the_plans_sglangs_per_step_refresh_computes(dsa_server, steps):
    """The one launch computes the schedule and the plan once per replay and copies them into every
    step; a second backend on SGLang's own path (which refreshes every step) ends with the same bits
    in every buffer."""
    server = dsa_server(num_steps=steps + 1)
    ours, stock = (server.multi_step(4, seeded=False) for _ in range(2))
    for multi in (ours, stock):
        server.capture(multi, DECODE, [4])
    stock_arm(stock)
    for lengths, slots in (([129, 0, 250, 64], [5, 2, 7, 1]), ([3, 299, 1, 200], [1, 3, 6, 4])):
        calls = []
        for multi in (ours, stock):
            for backend in multi.attn_backends:
                poison(backend.decode_cuda_graph_metadata[4], POISON)
            before = dict(server.calls)
            server.replay(multi, DECODE, lengths, slots)
            calls.append({k: v - before.get(k, 0) for k, v in server.calls.items() if v})
        assert calls[0] == {"schedule": 1, "topk_plan": 1}
        assert calls[1] == {"schedule": steps, "topk_plan": steps}
        for i, (a, b) in enumerate(zip(ours.attn_backends, stock.attn_backends)):
            got = metadata_tensors(a.decode_cuda_graph_metadata[4])
            want = metadata_tensors(b.decode_cuda_graph_metadata[4])
            for name in ("paged_mqa_schedule_metadata", "topk_v2_plan", "paged_mqa_ctx_lens_2d"):
                assert torch.equal(got[name], want[name]), f"step {i}: {name}"
            assert a.forward_metadata is a.decode_cuda_graph_metadata[4]


def test_flashmla_tile_metadata_is_computed_once_and_copied_into_every_step(dsa_server):
    """``flashmla_kv`` decode: computed once per replay, from step 0's clipped lengths, and copied
    into each step's buffers; every step ends with what SGLang's own path leaves there."""
    server = dsa_server(num_steps=4, decode_impl="flashmla_kv")
    ours, stock = (server.multi_step(BS, seeded=True) for _ in range(2))
    for multi in (ours, stock):
        server.capture(multi, DECODE, [BS])
    stock_arm(stock)
    for multi in (ours, stock):
        for backend in multi.attn_backends:
            poison(backend.decode_cuda_graph_metadata[BS], POISON)
    before = server.calls["flashmla"]
    server.replay(ours, DECODE, *ROUNDS[0])
    assert server.calls["flashmla"] - before == 1
    server.replay(stock, DECODE, *ROUNDS[0])
    for a, b in zip(ours.attn_backends, stock.attn_backends):
        got = a.decode_cuda_graph_metadata[BS].flashmla_metadata
        want = b.decode_cuda_graph_metadata[BS].flashmla_metadata
        assert torch.equal(got.flashmla_metadata, want.flashmla_metadata)
        assert torch.equal(got.num_splits, want.num_splits)


def test_capture_runs_sglang_and_decides_per_bs(dsa_server, hooked, caplog):
    """Every step backend gets SGLang's graph metadata for every captured bs; a bs whose step tables
    stopped matching (a re-capture, as adaptive speculation makes) keeps SGLang's path."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    server, multi = build(dsa_server, steps=3, captured=(1, BS))
    for backend in multi.attn_backends:
        assert {1, BS} <= {
            key for key in backend.decode_cuda_graph_metadata if isinstance(key, int)
        }
    metadata = multi.attn_backends[2].decode_cuda_graph_metadata[BS]
    wider = torch.zeros(BS, metadata.real_page_table.shape[1] + 1, dtype=torch.int32)
    object.__setattr__(metadata, "real_page_table", wider)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        server.capture(multi, DECODE, [BS])
    plans = state_of(multi, MultiStepState).batch_sizes
    assert plans[1].reason is None
    assert "step backend 2's real_page_table" in plans[BS].reason
    assert f"bs {BS} keeps SGLang's precompute + copies: step backend 2's" in caplog.text


BREAKAGES = {
    "hip": (lambda multi, hooked, set_platform: set_platform(cuda=False, hip=True), "HIP"),
    "not-cuda": (
        lambda multi, hooked, set_platform: set_platform(cuda=False, hip=False),
        "not a CUDA platform",
    ),
    "switch-off": (
        lambda multi, hooked, set_platform: hooked.setenv(BOUNDED_REPLAY_METADATA.env, "0"),
        "SGLANG_DSA_BOUNDED_REPLAY_METADATA=0",
    ),
    "kpool-4": (
        lambda multi, hooked, set_platform: setattr(multi.attn_backends[1], "dsa_index_kpool", 4),
        "dsa_index_kpool 4",
    ),
    "fusion": (
        lambda multi, hooked, set_platform: setattr(
            multi.attn_backends[0], "experimental_kpool_metadata_fusion", True
        ),
        "KPool metadata fusion",
    ),
    "five-steps": (
        lambda multi, hooked, set_platform: multi.attn_backends.append(multi.attn_backends[0]),
        "5 step backends",
    ),
    "mismatched-tables": (
        lambda multi, hooked, set_platform: object.__setattr__(
            multi.attn_backends[3].decode_cuda_graph_metadata[BS], "real_page_table", None
        ),
        "lacks real_page_table",
    ),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_gate_keeps_sglangs_path(dsa_server, hooked, set_platform, spies, breakage):
    """Decided again at a re-capture of the bs: SGLang's path replays it, our launch never runs."""
    hooked.setenv(LIVE_WIDTH.env, "0")
    _, multi = build(dsa_server, steps=4)
    breaking, reason = BREAKAGES[breakage]
    breaking(multi, hooked, set_platform)
    launched, stock = spies["one launch"], []
    batch = graph_batch(BS, DECODE, seq_lens=[1, 2, 3], req_pool_indices=[0, 1, 2])
    mtp.draft_decode_metadata(lambda *args, **kwargs: None, multi, batch, in_capture=True)
    assert reason in state_of(multi, MultiStepState).batch_sizes[BS].reason
    mtp.draft_decode_metadata(
        lambda self, fb, in_capture=False: stock.append(fb.batch_size), multi, batch
    )
    assert stock == [BS] and spies["one launch"] == launched


def test_a_failure_deciding_a_bs_at_capture_sends_it_to_sglangs_path_with_one_error(
    dsa_server, hooked, spies, caplog
):
    """Logged once at ERROR, as every other fallback, however often the bs is captured again."""
    hooked.setenv(LIVE_WIDTH.env, "0")

    def raising(multi, metas, bs):
        raise RuntimeError("injected failure")

    hooked.setattr(mtp, "one_launch_kwargs", raising)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        _, multi = build(dsa_server, steps=4, captured=(BS, BS))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [
        f"sglang_dsa_mtp: MTP draft-decode metadata for bs {BS} keeps SGLang's precompute + "
        "copies from now on: deciding its path raised: RuntimeError: injected failure"
    ]
    naming = [r for r in caplog.records if "injected failure" in r.getMessage()]
    assert [r.levelno for r in naming] == [logging.ERROR], "the INFO lines repeat the failure"
    launched, stock = spies["one launch"], []
    batch = graph_batch(BS, DECODE, seq_lens=[1, 2, 3], req_pool_indices=[0, 1, 2])
    mtp.draft_decode_metadata(
        lambda self, fb, in_capture=False: stock.append(fb.batch_size), multi, batch
    )
    assert stock == [BS] and spies["one launch"] == launched


@pytest.mark.parametrize(
    "live_width,path",
    [
        ("1", "replays each step backend's own metadata (the step backends have no page_table_1)"),
        ("0", "keeps SGLang's precompute + copies"),
    ],
    ids=["step-tables-dropped", "step-tables-kept"],
)
def test_a_raising_one_launch_sends_its_bs_to_sglangs_path_with_one_accurate_line(
    dsa_server, hooked, spies, caplog, live_width, path
):
    """The bs is rewritten at once by the path its step tables allow (no second failure), and every
    later replay of it takes that path; the buffers end as a backend that never tried ours."""
    hooked.setenv(LIVE_WIDTH.env, live_width)
    server = dsa_server(num_steps=5)
    ours, stock = (server.multi_step(BS, seeded=False) for _ in range(2))
    for multi in (ours, stock):
        server.capture(multi, DECODE, [BS])
    stock_arm(stock)

    def raising(**kwargs):
        raise RuntimeError("injected failure")

    # the one launch raising from now on: its wrapper, no launch bound
    hooked.setattr(state_of(ours, MultiStepState).batch_sizes[BS], "bound", None)
    hooked.setattr(mtp, "fused_dsa_draft_decode_metadata_multi", raising)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        for lengths, slots in ROUNDS:
            for multi in (ours, stock):
                for backend in multi.attn_backends:
                    poison(backend.decode_cuda_graph_metadata[BS], POISON)
                server.replay(multi, DECODE, lengths, slots)
            for a, b in zip(ours.attn_backends, stock.attn_backends):
                got = metadata_tensors(a.decode_cuda_graph_metadata[BS])
                for name, want in metadata_tensors(b.decode_cuda_graph_metadata[BS]).items():
                    assert torch.equal(got[name], want), name
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [
        f"sglang_dsa_mtp: MTP draft-decode metadata for bs {BS} {path} from now on: the one "
        "launch raised: RuntimeError: injected failure"
    ]
    assert "one launch raised" in state_of(ours, MultiStepState).batch_sizes[BS].reason


def test_a_replay_of_a_never_captured_bs_takes_sglangs_path(dsa_server, hooked, spies):
    hooked.setenv(LIVE_WIDTH.env, "0")
    server, multi = build(dsa_server, captured=(BS,))
    launched, stock = spies["one launch"], []
    batch = graph_batch(2, DECODE, seq_lens=[1, 2], req_pool_indices=[0, 1])
    mtp.draft_decode_metadata(lambda self, fb, in_capture=False: stock.append(fb), multi, batch)
    assert stock == [batch] and spies["one launch"] == launched
