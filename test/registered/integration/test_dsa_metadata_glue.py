"""The metadata glue: every DSA runner's replay prep through SGLang's ``MetadataGlueGraph``.

SGLang's DSA backends built and captured as a server does (``dsa_serving.Arm``: the target verify
through SGLang's ``DecodeCudaGraphRunner`` replay prep, the draft extend and the MTP draft decode
as their runners hand the prep), the plugin applied by SGLang's loader; off a GPU the glue's CUDA
graphs are simulated (``dsa_backends.cpu_glue_graphs``: a capture records the prep calls, a replay
makes them again with the capture's arguments). The serving loop (``test_serving_loop.py``) proves
the glue bit for bit over many rounds; these tests pin down when it engages, what it counts and
what happens when it cannot.
"""

import logging

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp import sglang_surface
from sglang_dsa_mtp.integration import dsa_metadata_glue as glue
from sglang_dsa_mtp.integration.state import BackendState, MultiStepState, RunnerState, peek
from support import dsa_backends as kit
from support import dsa_serving, serving_loop
from support.constants import POISON

# Off a GPU only: on a CUDA machine the serving loop's GPU form proves the glue under real graphs.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a CUDA machine the serving loop's GPU form runs instead"
)

LAUNCH = "3/1/4"
TOKENS = kit.LAUNCHES[LAUNCH][2]


@pytest.fixture
def arms(hooked):
    """``arms(on_env, launch, **server_args)``: (plugin arm with ``on_env``, SGLang's arm) of the
    EAGLE ``launch`` (None: no speculative decoding) with more ``server_args``, captured at max bs
    3 over one ``req_to_token``; the captured batch sizes as ``arms.captured``."""
    kit.cuda_stand_ins(hooked)
    sizes = dsa_serving.cpu_sizes(3)
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(sizes.pool, sizes.context + 4 + TOKENS, dtype=torch.int32)
    req_to_token[1:].random_(0, 1 << 30, generator=gen)

    def build(on_env=dsa_serving.ON, launch=LAUNCH, **server_args):
        tokens = TOKENS if launch else 1
        with dsa_serving.launch(launch, sizes, **server_args) as (_, captured):
            built = []
            for label, env, kernels in (
                ("on", on_env, None),
                ("off", dsa_serving.OFF, dsa_serving.sglang_metadata_kernels(sizes.device)),
            ):
                arm = dsa_serving.Arm(
                    label,
                    env,
                    sizes=sizes,
                    tokens=tokens,
                    req_to_token=req_to_token,
                    seeded=False,
                    kernels=kernels,
                )
                arm.capture(captured)
                built.append(arm)
        build.captured, build.launch = captured, lambda: dsa_serving.launch(launch, sizes)
        return built

    return build


def replay_both(on, off, op: str, lengths: list[int], slots: list[int], bs: int) -> list[str]:
    """One replay of ``op`` at the captured ``bs`` on both arms (``len(lengths)`` requests, padded to
    ``bs``), every written buffer poisoned first; the buffers the graphs read that differ."""
    device = torch.device("cpu")
    if op == "draft extend":
        lengths = [n + TOKENS for n in lengths]
    accepted = torch.ones(len(slots), dtype=torch.int32) if op == "draft extend" else None
    for arm in (on, off):
        arm.runners[op].poison(bs, POISON)
        arm.replay(
            op,
            bs,
            dsa_serving.request_tensor(lengths, device),
            dsa_serving.request_tensor(slots, device),
            accepted,
        )
    found = dsa_serving.differences(on.runners[op], off.runners[op], bs)
    return [name for name, differs in found if bool(differs)]


ROUNDS = (([5, 9, 40], [1, 2, 3], 3), ([77, 3], [4, 1], 3), ([12], [2], 1), ([128, 64], [3, 5], 2))


def test_every_runner_glues_every_captured_bs_at_capture_and_replays_padded_and_unpadded(arms):
    on, off = arms()
    assert serving_loop._captured_every_bs(on, arms.captured) == [True, True, True]
    assert serving_loop._captured_every_bs(off, arms.captured) == [False, False, False]
    for lengths, slots, bs in ROUNDS:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], (op, lengths, bs)
    for op, (graph, counts) in serving_loop.arm_glues(on).items():
        assert graph.replays == len(ROUNDS), op
        assert counts.routed == len(ROUNDS) and not counts.eager, (op, counts)
    runner = on.runners["target verify"].decode_runner
    assert glue.captured_glue(runner, RunnerState) is glue.captured_glue(on.target)
    # SGLang's own glue route replays the backend's glue, without the replay view
    assert runner._metadata_glue is glue.captured_glue(on.target)
    assert runner._skip_glued_replay_view
    assert glue.glue_counts(runner, RunnerState).padded == 1  # bs 3 from 2 requests
    assert glue.glue_counts(on.multi, MultiStepState).padded == 1
    assert glue.glue_counts(on.extend, BackendState).padded == 1
    for op, (graph, counts) in serving_loop.arm_glues(off).items():
        assert graph is None, op


def test_a_glued_replay_runs_no_prep_on_the_host(arms, hooked):
    """After capture, a replay of a captured key is one graph replay: the DSA prep's Python (its
    ``_apply_cuda_graph_metadata``) runs in none, only in the eager arm (the simulated graphs'
    replays, which make the captured calls again off a GPU, made to do nothing here: the glue
    keeps each graph's replay from its capture on)."""
    hooked.setattr(kit._CpuGraph, "replay", lambda self: None)
    on, off = arms()
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    ran = []
    apply = dsa_backend.DeepseekSparseAttnBackend._apply_cuda_graph_metadata

    def counted(self, *args, **kwargs):
        ran.append(self)
        return apply(self, *args, **kwargs)

    hooked.setattr(dsa_backend.DeepseekSparseAttnBackend, "_apply_cuda_graph_metadata", counted)
    for op in dsa_serving.OPS:
        on.replay(op, 2, *(dsa_serving.request_tensor(v, "cpu") for v in ([9, 9], [1, 2])))
    assert not [b for b in ran if b in on.backends().values()]


def test_sglangs_own_route_replays_an_unpadded_captured_key_with_no_code_of_the_plugins(
    arms, hooked
):
    """From the decode runner's second replay on, SGLang's own glue route replays each captured key
    of an unpadded batch: its replay prep never calls the prep through the replay view, where the
    plugin's hook sits. The first replay (which points the route at the glue) and a padded one go
    through the hook, to the same glue; with the plugin off, every replay takes the view."""
    on, off = arms()
    views = {arm.name: [] for arm in (on, off)}
    for arm in (on, off):
        runner = arm.runners["target verify"].decode_runner
        view_prep = type(runner)._init_replay_attn_metadata_from_view  # the hook around SGLang's

        def counted(*args, runner=runner, calls=views[arm.name], **kwargs):
            calls.append((kwargs["raw_bs"], kwargs["bs"]))
            return view_prep(runner, *args, **kwargs)

        hooked.setattr(runner, "_init_replay_attn_metadata_from_view", counted)
    for lengths, slots, bs in ROUNDS:
        assert replay_both(on, off, "target verify", lengths, slots, bs) == [], bs
    assert views["on"] == [(3, 3), (2, 3)]  # the first replay, the padded one
    assert views["off"] == [(len(lengths), bs) for lengths, _, bs in ROUNDS]
    graph, counts = serving_loop.arm_glues(on)["target verify"]
    assert graph.replays == len(ROUNDS) and counts.padded == 1 and not counts.eager


def test_an_mtp_padded_replay_on_other_inputs_than_the_captured_buffers_stays_eager(arms, hooked):
    """The MTP draft decode's graph of a bs reads the input buffers it was captured with. A padded
    replay handed other tensors (here: copies of them, SGLang's runner hands the buffers) runs the
    eager prep, right and counted with the reason; the first padded replay on the buffers is
    glued, and the check is not made again for that bs (the buffers stay until a recapture)."""
    on, off = arms()
    runner, reference = on.runners["draft decode"], off.runners["draft decode"]
    lengths, slots = (dsa_serving.request_tensor(v, "cpu") for v in ([40, 7], [2, 3]))
    state = peek(on.multi, MultiStepState).glue
    for arm_runner in (runner, reference):
        arm_runner.poison(3, POISON)
        arm_runner.replay(3, lengths, slots, in_place=lambda: None)  # the runner's input copies
    batch = runner._batch(3, runner.seq_lens[:3].clone(), runner.req_pool_indices[:3].clone())
    batch.num_padding = 1
    on.multi.init_forward_metadata_out_graph(batch)
    runner.graphs.replay(("draft decode", 3))
    reference.replay(3, lengths, slots)
    assert not [n for n, differs in dsa_serving.differences(runner, reference, 3) if differs]
    assert glue.glue_counts(on.multi, MultiStepState).eager == {glue.NOT_CAPTURED_BUFFERS: 1}
    assert 3 in state.inputs
    assert replay_both(on, off, "draft decode", [40, 7], [2, 3], 3) == []
    counts = glue.glue_counts(on.multi, MultiStepState)
    assert counts.routed == 1 and counts.padded == 1 and 3 not in state.inputs, counts


def test_a_draft_extend_replay_without_accept_lengths_is_glued_and_counted_unpadded(arms):
    """The draft extend's padded count reads the batch's ``num_accept_tokens`` after the glue graph
    replayed: a batch without them (no such field on its ``spec_info``) raises nothing into
    SGLang; its replay is glued and counted as not padded."""
    from types import SimpleNamespace

    on, _ = arms()
    runner = on.runners["draft extend"]
    batch = runner._batch(2, runner.seq_lens, runner.req_pool_indices)
    batch.spec_info = SimpleNamespace()
    assert on.extend.init_forward_metadata_out_graph(batch) is None
    counts = glue.glue_counts(on.extend, BackendState)
    assert counts.routed == 1 and counts.padded == 0 and not counts.eager, counts


def test_the_switch_off_keeps_every_prep_eager_and_says_so(arms, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        on, off = arms({**dsa_serving.ON, dsa_serving.GLUE_ENV: "0"})
        for lengths, slots, bs in ROUNDS[:2]:
            for op in dsa_serving.OPS:
                assert replay_both(on, off, op, lengths, slots, bs) == []
    assert [graph for graph, _ in serving_loop.arm_glues(on).values()] == [None] * 3
    off_lines = [r.getMessage() for r in caplog.records if "metadata_glue off" in r.getMessage()]
    assert any("SGLANG_DSA_METADATA_GLUE=0" in line for line in off_lines), off_lines
    assert peek(on.extend, BackendState).glue.reason == "SGLANG_DSA_METADATA_GLUE=0"


def test_a_capture_that_raises_turns_that_glue_off_and_the_prep_stays_right(arms, hooked, caplog):
    """SGLang's class turns a glue off when its capture raises (and runs that prep eagerly): the
    runner's replays stay eager and bit-identical, counted as eager with the reason."""

    def failing(graph, **options):
        raise RuntimeError("capture refused")

    hooked.setattr(torch.cuda, "graph", failing)
    on, off = arms()
    for lengths, slots, bs in ROUNDS:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], (op, bs)
    for op, (graph, counts) in serving_loop.arm_glues(on).items():
        assert graph.disabled and graph.replays == 0, op
        assert counts.eager == {glue.OFF: len(ROUNDS)}, (op, counts)


def test_an_error_at_the_runner_hook_site_sends_that_runner_to_the_eager_prep(arms, hooked, caplog):
    """The glue raising at the hook site (here: its replay, at the runner's first replay prep)
    turns the runner's glue off, logged once at ERROR, and gives SGLang's route back the glue it
    had (none): every replay eager, right."""
    on, off = arms()

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    hooked.setattr(glue.captured_glue(on.target), "replay", broken)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        for lengths, slots, bs in ROUNDS:
            assert replay_both(on, off, "target verify", lengths, slots, bs) == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len([e for e in errors if "metadata glue is off" in e]) == 1, errors
    runner = on.runners["target verify"].decode_runner
    assert peek(runner, RunnerState).glue.reason == "raised RuntimeError: planted"
    assert runner._metadata_glue is None and not runner._skip_glued_replay_view
    assert glue.captured_glue(on.target).replays == 0


def test_a_runner_whose_captured_keys_are_not_sglangs_keeps_its_prep_eager(arms, hooked, caplog):
    """At the runner's first replay prep every key its backend's glue captured is checked against
    the key SGLang's route looks up (here another): the route stays SGLang's, logged at ERROR."""
    on, off = arms()
    hooked.setattr(sglang_surface, "replay_glue_key", lambda *args: ("another key",))
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        for lengths, slots, bs in ROUNDS:
            assert replay_both(on, off, "target verify", lengths, slots, bs) == []
    runner = on.runners["target verify"].decode_runner
    reason = peek(runner, RunnerState).glue.reason
    assert reason.startswith("the gate raised LookupError: the glue captured bs 3 as"), reason
    assert runner._metadata_glue is None and glue.captured_glue(on.target).replays == 0
    assert [r for r in caplog.records if r.levelno == logging.ERROR]


def test_the_draft_extend_keeps_its_prep_eager_where_it_reads_the_rounds_accept_lengths(
    hooked,
):
    """At ``dsa_index_kpool`` > 1 the draft-extend prep reads the round's ``num_accept_tokens``
    (an unpadded replay's own tensor): no glue, with that reason."""
    from support.dsa_backends import CpuDsaServer

    hooked.setenv(dsa_serving.GLUE_ENV, "1")
    server = CpuDsaServer(hooked, kpool=2)
    try:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        backend = server.draft_extend(2)
        server.capture(backend, ForwardMode.DRAFT_EXTEND_V2, [1, 2])
        assert "dsa_index_kpool is 2" in peek(backend, BackendState).glue.reason
    finally:
        server.close()


@pytest.mark.quick
def test_the_decode_runner_declines_a_backend_that_is_not_dsas(hooked):
    from types import SimpleNamespace

    hooked.setenv(dsa_serving.GLUE_ENV, "1")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seq_lens, slots = torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    runner = dsa_serving.decode_runner(
        SimpleNamespace(),
        ForwardMode.DECODE,
        seq_lens=seq_lens,
        req_pool_indices=slots,
        max_tokens=2,
    )
    ran = []
    forward_batch, kwargs = dsa_serving.replay_prep_arguments(runner, raw_bs=1, bs=2, num_tokens=2)
    del kwargs["early_staged"]  # not the view prep's
    glue.glue_replay_view_prep(lambda *a, **k: ran.append(k), runner, forward_batch, **kwargs)
    reason = peek(runner, RunnerState).glue.reason
    assert reason == "its attention backend is SimpleNamespace, not DSA's"
    assert runner._metadata_glue is None and ran[0]["glue_key"] == kwargs["glue_key"]


def test_a_bs_not_captured_with_the_servers_graphs_stays_eager_and_is_counted(arms, hooked):
    """No glue captures while serving: a bs whose capture was skipped (here: bs 2, as inside a
    stream capture) replays eagerly in every runner, bit-identical, counted with the reason."""
    capture_key = glue._capture_key

    def skipping(state, forward_batch, key):
        return forward_batch.batch_size != 2 and capture_key(state, forward_batch, key)

    hooked.setattr(glue, "_capture_key", skipping)
    on, off = arms()
    for lengths, slots, bs in ROUNDS:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], (op, bs)
    # SGLang's class runs a new key eagerly twice, then captures it: three more unpadded replays
    # of bs 2 would capture it, were its key handed to SGLang's glue while serving
    for _ in range(3):
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, [50, 60], [1, 2], 2) == [], op
    for op, (graph, counts) in serving_loop.arm_glues(on).items():
        assert counts.routed == len(ROUNDS) - 1 and graph.replays == len(ROUNDS) - 1, op
        assert counts.eager == {glue.NOT_CAPTURED: 4}, (op, counts)
        assert not graph.is_captured(serving_loop.glue_key_of(on.runners[op], 2)), op
        assert not [k for k in graph._states if k[0] == 2], op  # SGLang's per-key record


@pytest.mark.quick
def test_a_glued_prep_allocates_in_the_shared_pool_while_a_stream_captures_it(monkeypatch):
    """What a prep allocates inside its capture goes to the pool every glue graph shares (on a GPU
    the serving loop checks that no glue graph holds a pool of its own); outside a capture, and
    off CUDA, it allocates as it would."""
    import contextlib

    entered, capturing = [], [False]

    @contextlib.contextmanager
    def use_mem_pool(pool):
        entered.append(pool)
        yield
        entered.remove(pool)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    ran, pool = [], object()
    shared = glue.GluedPrep(lambda fb: ran.append((fb, list(entered))), [], pool)
    alone = glue.GluedPrep(lambda fb: ran.append((fb, list(entered))), [], None)
    shared.init_forward_metadata_out_graph("warm-up")
    capturing[0] = True
    shared.init_forward_metadata_out_graph("capture")
    alone.init_forward_metadata_out_graph("capture off CUDA")
    assert ran == [("warm-up", []), ("capture", [pool]), ("capture off CUDA", [])]
    assert glue.glue_pool("cpu") == (None, None)


def test_the_decode_runner_replays_only_keys_of_its_capture_mode(arms):
    """A backend's glue keys its captures by batch size and mode (SGLang's full key): a key of
    another mode at the same bs (here planted, DECODE beside the TARGET_VERIFY captures) is never
    the verify runner's, and every verify replay stays glued."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    on, off = arms()
    keys = peek(on.target, BackendState).glue.keys
    keys[3, ForwardMode.DECODE] = glue.glue_key(3, ForwardMode.DECODE)  # captured last
    for lengths, slots, bs in ROUNDS:
        assert replay_both(on, off, "target verify", lengths, slots, bs) == [], bs
    runner = on.runners["target verify"].decode_runner
    state = peek(runner, RunnerState).glue
    assert state.reason is None
    assert state.replays[3] == glue.glue_key(3, ForwardMode.TARGET_VERIFY)
    assert glue.glue_counts(runner, RunnerState).routed == len(ROUNDS)


def test_a_replay_in_another_mode_than_the_capture_runs_eagerly_counted_as_such(arms):
    """An IDLE replay of the verify runner (SGLang's key for it was never captured) runs SGLang's
    eager prep, counted under its own reason, not as an uncaptured key."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    on, off = arms()
    replay_both(on, off, "target verify", [5, 9, 40], [1, 2, 3], 3)  # the runner decides
    runner = on.runners["target verify"].decode_runner
    batch, kwargs = dsa_serving.replay_prep_arguments(runner, raw_bs=3, bs=3, num_tokens=3 * TOKENS)
    batch.forward_mode = ForwardMode.IDLE
    kwargs["glue_key"] = runner._glue_key(3, str(ForwardMode.IDLE), None)
    runner._init_replay_attn_metadata(batch, **kwargs)
    counts = glue.glue_counts(runner, RunnerState)
    assert counts.eager == {glue.OTHER_MODE: 1} and counts.routed == 1, counts
    assert not glue.captured_glue(on.target).is_captured(kwargs["glue_key"])


def test_breakable_decode_graphs_keep_every_prep_eager(hooked):
    """SGLang's breakable decode graphs run attention eagerly inside a replay, reading what the
    prep resets and a glued replay skips: read from the server's own graph config, the glue stays
    off, with the reason."""
    from sglang.srt.model_executor.cuda_graph_config import (
        Backend,
        Phase,
        default_cuda_graph_config,
        with_phase,
    )

    hooked.setenv(dsa_serving.GLUE_ENV, "1")
    breakable = with_phase(default_cuda_graph_config(), Phase.DECODE, backend=Backend.BREAKABLE)
    with kit.serving(LAUNCH, cuda_graph_config=breakable):
        assert sglang_surface.breakable_decode_graphs()
        reason = glue._why_not_server("cpu")
    assert reason is not None and reason.startswith("breakable decode graphs"), reason
    with kit.serving(LAUNCH):
        assert not sglang_surface.breakable_decode_graphs()
        assert glue._why_not_server("cpu") is None


@pytest.mark.quick
def test_two_batch_overlap_and_pdmux_keep_every_prep_eager(hooked):
    """A backend per micro-batch or per stream: the decode runner never routes to the glue, so no
    backend captures one (no glue graph kept that no replay uses)."""
    hooked.setenv(dsa_serving.GLUE_ENV, "1")
    with kit.serving(LAUNCH, enable_two_batch_overlap=True):
        assert glue._why_not_server("cpu").startswith("two-batch overlap")
    with kit.serving(LAUNCH, enable_pdmux=True):
        assert glue._why_not_server("cpu").startswith("pdmux")


def test_a_failed_pool_probe_keeps_every_prep_eager_with_the_reason(arms, hooked):
    """Where torch would not put a glue capture's allocations in the shared pool (the probe at the
    pool's making says why), no runner glues: each keeps its eager prep, with that reason."""
    hooked.setattr(glue, "glue_pool", lambda device: (None, "the probe's reason"))
    on, off = arms()
    for lengths, slots, bs in ROUNDS[:2]:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], op
    assert peek(on.target, BackendState).glue.reason == "the probe's reason"
    assert peek(on.multi, MultiStepState).glue.reason == "the probe's reason"
    assert [graph for graph, _ in serving_loop.arm_glues(on).values()] == [None] * 3


def test_a_non_speculative_servers_decode_runner_glues_its_replays_padded_and_unpadded(arms):
    """A DSA server without speculative decoding: its one runner, plain decode, through SGLang's
    decode runner, glued at every captured bs, bit-identical to SGLang's eager prep."""
    on, off = arms(launch=None)
    assert list(on.runners) == [dsa_serving.DECODE]
    for lengths, slots, bs in ROUNDS:
        assert replay_both(on, off, dsa_serving.DECODE, lengths, slots, bs) == [], bs
    runner = on.runners[dsa_serving.DECODE].decode_runner
    counts = glue.glue_counts(runner, RunnerState)
    assert counts.routed == len(ROUNDS) and counts.padded == 1 and not counts.eager, counts
    assert runner._metadata_glue is glue.captured_glue(on.target)
    assert glue.captured_glue(off.runners[dsa_serving.DECODE].decode_runner, RunnerState) is None


def test_a_lora_server_keeps_the_targets_prep_eager_and_glues_the_unadapted_draft(arms):
    """With LoRA adapters (on the target model only; SGLang's draft runs unadapted): the target's
    backend captures no glue (no graph kept that no replay uses) and its verify runner keeps the
    eager prep, saying why; the draft extend and the MTP draft decode are glued; every replay
    bit-identical to SGLang's."""
    on, off = arms(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])
    for lengths, slots, bs in ROUNDS:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], (op, bs)
    assert peek(on.target, BackendState).glue.reason == glue.LORA
    assert glue.captured_glue(on.target) is None
    runner = on.runners["target verify"].decode_runner
    assert glue.LORA in peek(runner, RunnerState).glue.reason
    assert glue.glue_counts(runner, RunnerState).routed == 0
    for owner, kind in ((on.extend, BackendState), (on.multi, MultiStepState)):
        counts = glue.glue_counts(owner, kind)
        assert counts.routed == len(ROUNDS) and not counts.eager, counts


def test_a_dflash_server_glues_no_runner(arms):
    """DFlash-family speculative decoding feeds its verify plans from the host (SGLang keeps its
    own glue off for it): no runner glues, the reason said, every replay bit-identical."""
    on, off = arms(launch=None, speculative_algorithm="DFLASH")
    for lengths, slots, bs in ROUNDS:
        assert replay_both(on, off, dsa_serving.DECODE, lengths, slots, bs) == [], bs
    assert "DFlash" in peek(on.target, BackendState).glue.reason
    assert glue.captured_glue(on.target) is None


@pytest.mark.parametrize("live_width", ["1", "0"])
def test_a_recapture_drops_every_glue_and_captures_it_again_on_the_new_graph_state(
    arms, live_width
):
    """SGLang's recapture while serving (a weight update with ``recapture_cuda_graph``, elastic EP):
    each backend's graph state built again, every bs captured again by new runners. The old glue
    graphs are reset (no captured graph, no metadata snapshot kept), new ones are captured on the
    new buffers, and every replay after it is glued and bit-identical; with live width off too (the
    graph-state hooks drop the glue whatever that switch says)."""
    on, off = arms({**dsa_serving.ON, "SGLANG_DSA_LIVE_WIDTH": live_width})
    for lengths, slots, bs in ROUNDS[:2]:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], op
    old = {op: graph for op, (graph, _) in serving_loop.arm_glues(on).items()}
    with arms.launch():
        for arm in (on, off):
            arm.recapture(arms.captured)
    for op, graph in old.items():
        assert not graph._states, op  # SGLang's per-key record: no key seen, none captured
        keys = [serving_loop.glue_key_of(on.runners[op], bs) for bs in arms.captured]
        assert not [key for key in keys if graph.is_captured(key)], op
    assert serving_loop._captured_every_bs(on, arms.captured) == [True, True, True]
    for lengths, slots, bs in ROUNDS:
        for op in dsa_serving.OPS:
            assert replay_both(on, off, op, lengths, slots, bs) == [], (op, bs)
    for op, (graph, counts) in serving_loop.arm_glues(on).items():
        assert graph is not old[op], op
        assert counts.routed == len(ROUNDS) and not counts.eager, (op, counts)
