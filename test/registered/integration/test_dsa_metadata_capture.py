"""At capture, every batch size's replay-metadata kernel is compiled before serving, and each backend
says once what decided its kernels.

SGLang's real DSA backends, built, captured and replayed by SGLang's own code on the CPU
(``support.dsa_backends``). Triton's interpreter compiles nothing, so these tests check
the calls: the warm-up runs once per captured batch size, outside stream capture, for our kernel and
for SGLang's kernel behind it, with the very arguments SGLang's replay of that batch size passes to
each (the same buffers, inputs of the same dtype, shape and strides), and writes nothing the replay
reads. That no compile is left for the replays, ours or SGLang's after a fallback, is checked on the
GPU (``test/registered/kernels/ops/attention/test_warm_up_compiles.py``).
"""

import logging

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

import sglang.srt.layers.attention.dsa.dsa_backend_mtp_precompute as precompute
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.integration import dsa_metadata_capture as capture
from sglang_dsa_mtp.integration import dsa_metadata_selection as selection
from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
from sglang_dsa_mtp.integration import fallback
from sglang_dsa_mtp.integration.state import MultiStepState, state_of
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, LIVE_WIDTH
from support.dsa_backends import metadata_tensors

CAPTURED = [1, 2, 4]
MODES = {
    "decode": (ForwardMode.DECODE, "target"),
    "target verify": (ForwardMode.TARGET_VERIFY, "target"),
    "draft extend": (ForwardMode.DRAFT_EXTEND_V2, "draft_extend"),
}
INPUTS = ("seq_lens", "req_pool_indices", "extend_seq_lens")
ATTRS = {name: attr for attr, _, name in selection.KERNELS}  # the backend attribute of each op


def signature(kwargs) -> dict:
    """What decides the kernel variant and the buffers a call writes: each buffer by identity,
    each input by dtype, shape and strides, each other argument by value."""
    result = {}
    for name, value in kwargs.items():
        if name == "destinations":
            result[name] = [tuple(map(id, dest)) for dest in value]
        elif name in INPUTS:
            result[name] = (value.dtype, tuple(value.shape), value.stride())
        elif isinstance(value, torch.Tensor):
            result[name] = id(value)
        else:
            result[name] = value
    return result


class Recorder:
    """Records each call's keyword arguments, then calls ``fn``."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(hooked):
    """Record every warm-up (the kernel and its arguments) and every call of our kernels."""
    warm_ups = []

    def record_warm_up(kernel, **kwargs):
        warm_ups.append((kernel, kwargs))
        return real_warm_up(kernel, **kwargs)

    real_warm_up = fallback.warm_up
    hooked.setattr(fallback, "warm_up", record_warm_up)
    hooked.setattr(mtp, "warm_up", record_warm_up)
    kernels = {name: Recorder(ours) for _, ours, name in selection.KERNELS}
    hooked.setattr(
        selection, "KERNELS", tuple((a, kernels[name], name) for a, _, name in selection.KERNELS)
    )
    one_launch = Recorder(mtp.fused_dsa_draft_decode_metadata_multi)
    hooked.setattr(mtp, "fused_dsa_draft_decode_metadata_multi", one_launch)
    return warm_ups, kernels, one_launch


@pytest.mark.quick
def test_plugin_hooks_the_graph_metadata_build():
    targets = {row.target for row in hooks.rows_of(BOUNDED_REPLAY_METADATA)}
    assert (
        "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend."
        "_build_forward_metadata_cuda_graph"
    ) in targets


@pytest.mark.parametrize("op", list(MODES))
def test_each_captured_bs_is_warmed_up_with_the_call_its_replays_make(dsa_server, spies, op):
    warm_ups, kernels, _ = spies
    mode, kind = MODES[op]
    server = dsa_server()
    backend = getattr(server, kind)(max(CAPTURED))
    server.capture(backend, mode, CAPTURED)
    ours = [kwargs for kernel, kwargs in warm_ups if kernel is kernels[op]]
    assert [kwargs["bs"] for kwargs in ours] == sorted(CAPTURED, reverse=True)
    assert_ran_on_twins(ours, kernels[op].calls)
    kernels[op].calls.clear()
    for bs in CAPTURED:
        server.replay(backend, mode, [9] * bs, list(range(1, bs + 1)))
    replayed = {kwargs["bs"]: kwargs for kwargs in kernels[op].calls}
    for warm in ours:
        assert signature(warm) == signature(replayed[warm["bs"]])


def assert_ran_on_twins(warm_ups, calls):
    """Each warm-up's kernel call ran on buffers of its own: only req_to_token (read-only) is the
    captured one."""
    assert len(calls) == len(warm_ups)
    for warm, twin in zip(warm_ups, calls):
        for name, value in warm.items():
            if isinstance(value, torch.Tensor) and name != "req_to_token":
                assert twin[name].data_ptr() != value.data_ptr(), name


def raise_injected(**kwargs):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("op", list(MODES))
def test_sglangs_kernel_is_warmed_up_per_captured_bs_with_the_call_a_fallback_replay_makes(
    dsa_server, spies, op
):
    """SGLang's kernel specializes on bs: the per-bs fallback's first replay would compile it while
    serving, so the capture warms it up too, with the arguments a replay that falls back passes."""
    warm_ups, kernels, _ = spies
    mode, kind = MODES[op]
    server = dsa_server()
    backend = getattr(server, kind)(max(CAPTURED))
    guarded = fallback.fallback_of(getattr(backend, ATTRS[op]))
    sglang = guarded.sglang = Recorder(guarded.sglang)
    server.capture(backend, mode, CAPTURED)
    warmed = [kwargs for kernel, kwargs in warm_ups if kernel is sglang]
    assert [kwargs["bs"] for kwargs in warmed] == sorted(CAPTURED, reverse=True)
    assert_ran_on_twins(warmed, sglang.calls)
    assert guarded.failed == set(), "a warm-up of SGLang's kernel sent a bs to it"
    sglang.calls.clear()
    kernels[op].fn = raise_injected  # every replay falls back
    for bs in CAPTURED:
        server.replay(backend, mode, [9] * bs, list(range(1, bs + 1)))
    assert guarded.failed == set(CAPTURED)
    replayed = {kwargs["bs"]: kwargs for kwargs in sglang.calls}
    for warm in warmed:
        assert signature(warm) == signature(replayed[warm["bs"]])


@pytest.mark.parametrize("failing", ["ours", "sglang"])
def test_a_raising_warm_up_never_takes_the_capture_down(dsa_server, spies, caplog, failing):
    """Ours raising at its warm-up sends that bs to SGLang's kernel, which is warmed up all the same;
    SGLang's raising is logged once and leaves every bs on ours."""
    warm_ups, kernels, _ = spies
    server = dsa_server()
    backend = server.target(max(CAPTURED))
    guarded = fallback.fallback_of(backend._fused_verify_metadata)
    sglang = guarded.sglang = Recorder(guarded.sglang)
    if failing == "ours":
        kernels["target verify"].fn = raise_injected
    else:
        sglang.fn = raise_injected
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        server.capture(backend, ForwardMode.TARGET_VERIFY, CAPTURED)
    warmed = sorted(kwargs["bs"] for kernel, kwargs in warm_ups if kernel is sglang)
    assert warmed == CAPTURED
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    if failing == "ours":
        assert guarded.failed == set(CAPTURED)
        assert len(errors) == len(CAPTURED)
        assert all("falls back to SGLang's kernel" in error for error in errors)
    else:
        assert guarded.failed == set()
        assert errors == [
            "sglang_dsa_mtp: warming up SGLang's DSA target verify replay metadata kernel for bs "
            f"{max(CAPTURED)} failed (a replay that falls back to it compiles it first): "
            "RuntimeError: injected failure"
        ]


def test_an_error_building_the_replay_call_sends_that_bs_to_sglangs_kernel(
    dsa_server, spies, hooked, caplog
):
    """Without its replay's arguments a bs cannot be warmed up: its replays take SGLang's kernel (as
    stock SGLang's do), never ours, which would first compile on a live request. The other batch
    sizes are warmed up and keep ours."""
    warm_ups, kernels, _ = spies
    real, seen = capture.get_platform, []

    def platform_raising_once():  # read only to build the target-verify replay's arguments
        seen.append(True)
        if len(seen) == 1:
            raise RuntimeError("injected failure")
        return real()

    hooked.setattr(capture, "get_platform", platform_raising_once)
    server = dsa_server()
    backend = server.target(max(CAPTURED))
    guarded, first = fallback.fallback_of(backend._fused_verify_metadata), max(CAPTURED)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        server.capture(backend, ForwardMode.TARGET_VERIFY, CAPTURED)
    rest = sorted(set(CAPTURED) - {first})
    assert guarded.failed == {first}
    ours = kernels["target verify"]
    assert sorted(kwargs["bs"] for kernel, kwargs in warm_ups if kernel is ours) == rest
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"sglang_dsa_mtp: DSA target verify replay metadata for bs {first} falls back to SGLang's "
        "kernel: ours raised: RuntimeError: injected failure"
    ]
    ours.calls.clear()
    for bs in CAPTURED:
        server.replay(backend, ForwardMode.TARGET_VERIFY, [9] * bs, list(range(1, bs + 1)))
    assert sorted(kwargs["bs"] for kwargs in ours.calls) == rest


@pytest.mark.parametrize("op", list(MODES))
def test_the_warm_up_leaves_the_captured_buffers_as_sglang_built_them(dsa_server, hooked, op):
    mode, kind = MODES[op]
    server = dsa_server()
    built = {}

    def snapshot_then_warm_up(kernel, **kwargs):
        if kwargs["bs"] not in built:  # before the first warm-up of the bs (ours, then SGLang's)
            metadata = backend.decode_cuda_graph_metadata[kwargs["bs"]]
            built[kwargs["bs"]] = {k: v.clone() for k, v in metadata_tensors(metadata).items()}
        real_warm_up(kernel, **kwargs)

    real_warm_up = fallback.warm_up
    hooked.setattr(fallback, "warm_up", snapshot_then_warm_up)
    backend = getattr(server, kind)(max(CAPTURED))
    server.capture(backend, mode, CAPTURED)
    assert sorted(built) == CAPTURED
    for bs, before in built.items():
        after = metadata_tensors(backend.decode_cuda_graph_metadata[bs])
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), f"bs {bs}: the warm-up wrote {name}"


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_the_mtp_one_launch_is_warmed_up_per_captured_bs_with_its_replay_call(
    dsa_server, spies, seeded
):
    warm_ups, _, one_launch = spies
    server = dsa_server()
    multi = server.multi_step(max(CAPTURED), seeded=seeded)
    server.capture(multi, ForwardMode.DECODE, CAPTURED)
    ours = [kwargs for kernel, kwargs in warm_ups if kernel is one_launch]
    assert [kwargs["bs"] for kwargs in ours] == sorted(CAPTURED, reverse=True)
    assert len(ours[0]["destinations"]) == server.num_steps - 1
    for bs in CAPTURED:
        server.replay(multi, ForwardMode.DECODE, [9] * bs, list(range(1, bs + 1)))
    replayed = {kwargs["bs"]: kwargs for kwargs in one_launch.calls if kwargs["seq_lens"][0] == 9}
    for warm in ours:
        assert signature(warm) == signature(replayed[warm["bs"]])


def variant(kwargs) -> dict:
    """What decides the variant a call of a replay-metadata kernel compiles: each tensor by dtype,
    dimensions, 16-byte alignment and strides but a table's row stride (which no kernel specializes
    on), each other argument by value. Buffers of another identity (SGLang's precompute allocates
    its own) find the same variant."""
    result = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            strides = value.stride()[1:] if value.dim() == 2 else value.stride()
            result[name] = (value.dtype, value.dim(), strides, value.data_ptr() % 16 == 0)
        else:
            result[name] = value
    return result


@pytest.mark.parametrize("answering", ["ours", "sglang"])
@pytest.mark.parametrize("live_width", ["1", "0"], ids=["step-tables-dropped", "step-tables-kept"])
def test_the_paths_a_failed_one_launch_takes_meet_only_warmed_up_kernels(
    dsa_server, spies, hooked, answering, live_width
):
    """A bs whose one launch raises replays each step backend's own metadata (step tables dropped) or
    SGLang's precompute + copies (kept): each decode kernel call they make, ours or SGLang's behind
    it, is a variant warmed up at capture, and SGLang's JIT copies were loaded at capture."""
    warm_ups, kernels, one_launch = spies
    hooked.setenv(LIVE_WIDTH.env, live_width)
    # The precompute's CUDA branch, which calls step 0's decode kernel (its own flag, read at import).
    hooked.setattr(precompute, "_is_cuda", True)
    server = dsa_server(num_steps=5)
    multi = server.multi_step(max(CAPTURED), seeded=True)
    sglang = Recorder(fallback.fallback_of(multi.attn_backends[0]._fused_decode_metadata).sglang)
    for backend in multi.attn_backends:
        fallback.fallback_of(backend._fused_decode_metadata).sglang = sglang
    server.capture(multi, ForwardMode.DECODE, CAPTURED)
    loaded = set(server.stand_ins.jit_loads)
    one_launch.fn = raise_injected
    if answering == "sglang":
        kernels["decode"].fn = raise_injected
    kernel = sglang if answering == "sglang" else kernels["decode"]
    kernel.calls.clear()
    server.stand_ins.jit_loads.clear()
    for bs in CAPTURED:
        server.replay(multi, ForwardMode.DECODE, [9] * bs, list(range(1, bs + 1)))
    warmed = [variant(kwargs) for warmed, kwargs in warm_ups if warmed is kernel]
    assert kernel.calls, "the other path never called the kernel"
    for call in kernel.calls:
        assert variant(call) in warmed, f"bs {call['bs']}: a variant no warm-up compiled"
    if live_width == "0":
        assert server.stand_ins.jit_loads, "SGLang's precompute + copies loaded no JIT copy"
    assert set(server.stand_ins.jit_loads) <= loaded


def test_the_jit_copies_are_not_loaded_where_the_step_tables_are_dropped(dsa_server, hooked):
    """Without the step backends' wide tables SGLang's precompute + copies never runs."""
    hooked.setenv(LIVE_WIDTH.env, "1")
    server = dsa_server(num_steps=5)
    server.capture(server.multi_step(2, seeded=True), ForwardMode.DECODE, [2])
    assert server.stand_ins.jit_loads == []


@pytest.mark.parametrize(
    "live_width,path",
    [
        ("1", "replays each step backend's own metadata (the step backends have no page_table_1)"),
        ("0", "keeps SGLang's precompute + copies"),
    ],
    ids=["step-tables-dropped", "step-tables-kept"],
)
def test_a_raising_one_launch_warm_up_sends_that_bs_to_another_path(
    dsa_server, hooked, caplog, live_width, path
):
    def raising(kernel, **kwargs):
        if kwargs["bs"] == 4:
            raise RuntimeError("injected failure")

    hooked.setattr(mtp, "warm_up", raising)
    hooked.setenv(LIVE_WIDTH.env, live_width)
    server = dsa_server()
    multi = server.multi_step(4, seeded=True)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        server.capture(multi, ForwardMode.DECODE, [1, 4])
    plans = state_of(multi, MultiStepState).batch_sizes
    assert plans[1].reason is None
    assert "its warm-up raised RuntimeError: injected failure" in plans[4].reason
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error == (
        f"sglang_dsa_mtp: MTP draft-decode metadata for bs 4 {path} from now on: its warm-up "
        "raised: RuntimeError: injected failure"
    )


@pytest.mark.quick
def test_no_warm_up_inside_a_stream_capture(dsa_server, spies, hooked, caplog):
    warm_ups, _, _ = spies
    server = dsa_server()
    backend = server.target(2)
    hooked.setattr(torch.cuda, "is_available", lambda: True)
    hooked.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger="sglang_dsa_mtp"):
        server.capture(backend, ForwardMode.TARGET_VERIFY, [2])
    assert warm_ups == []
    assert "inside a stream capture: not warmed up" in caplog.text


def test_backends_off_the_bounded_kernels_are_not_warmed_up(dsa_server, spies, hooked):
    warm_ups, _, _ = spies
    server = dsa_server()
    hooked.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    backend = server.target(2)
    server.capture(backend, ForwardMode.TARGET_VERIFY, [2])
    assert warm_ups == []


# ------------------------------------------------------------------------------------------------
# The start-up lines: one per feature and backend, with the facts that decided it
# ------------------------------------------------------------------------------------------------


METADATA_FEATURES = ("bounded_replay_metadata ", "one-launch MTP draft-decode metadata ")


def startup_lines(caplog) -> list[str]:
    """The INFO lines of the two replay-metadata changes (other switches log their own)."""
    return [
        message
        for message in (r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        if any(f"sglang_dsa_mtp: {feature}" in message for feature in METADATA_FEATURES)
    ]


def test_each_backend_says_once_what_decided_its_kernels(dsa_server, caplog):
    server = dsa_server()
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, extend = server.target(4), server.draft_extend(4)
        multi = server.multi_step(4, seeded=True)
        server.capture(target, ForwardMode.TARGET_VERIFY, [1, 4])
        server.capture(extend, ForwardMode.DRAFT_EXTEND_V2, [1, 4])
        server.capture(multi, ForwardMode.DECODE, [1, 4])
    facts = "bounded kernels (index_kpool 1, KPool fusion off)"
    assert startup_lines(caplog) == [
        f"sglang_dsa_mtp: bounded_replay_metadata on for the target-verify backend: {facts}",
        f"sglang_dsa_mtp: bounded_replay_metadata on for the draft-extend backend: {facts}",
        f"sglang_dsa_mtp: bounded_replay_metadata on for the MTP draft step 0 backend: {facts}",
        f"sglang_dsa_mtp: bounded_replay_metadata on for the MTP draft step 1 backend: {facts}",
        f"sglang_dsa_mtp: bounded_replay_metadata on for the MTP draft step 2 backend: {facts}",
        "sglang_dsa_mtp: one-launch MTP draft-decode metadata on for the MTP draft-decode backend "
        "(3 step backends, seeded steps: indexer plans not refreshed, index_kpool 1, KPool fusion "
        "off, decode impl fa3); first captured bs 4 uses one launch",
    ]


def test_a_backend_off_the_bounded_kernels_names_what_stopped_them(dsa_server, hooked, caplog):
    server = dsa_server()
    hooked.setenv(BOUNDED_REPLAY_METADATA.env, "0")
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        server.capture(server.target(2), ForwardMode.TARGET_VERIFY, [2])
        server.capture(server.multi_step(2, seeded=False), ForwardMode.DECODE, [2])
    lines = startup_lines(caplog)
    assert lines[0] == (
        "sglang_dsa_mtp: bounded_replay_metadata off for the target-verify backend, SGLang's "
        "kernels: SGLANG_DSA_BOUNDED_REPLAY_METADATA=0 (index_kpool 1, KPool fusion off)"
    )
    assert lines[-1] == (
        "sglang_dsa_mtp: one-launch MTP draft-decode metadata off for the MTP draft-decode backend "
        "(3 step backends, unseeded steps: indexer plans refreshed once per round, copied to every "
        "step, index_kpool 1, KPool fusion off, decode impl fa3); first captured bs 2 keeps "
        "SGLang's precompute + copies: SGLANG_DSA_BOUNDED_REPLAY_METADATA=0"
    )
