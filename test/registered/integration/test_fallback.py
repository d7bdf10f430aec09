"""A bounded replay-metadata kernel that raises never takes the replay down: SGLang's kernel takes over.

On SGLang's real ``DeepseekSparseAttnBackend`` built, captured and replayed by SGLang's own code on the
CPU (``support.dsa_backends``), with one of our kernels swapped for a wrapper that raises at
one batch size: that batch size's replays write what SGLang's kernel writes, bit for bit, every buffer
of the metadata compared with a backend that runs SGLang's kernels; the error is logged once; other
batch sizes keep ours.
"""

import logging

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsa_mtp.integration import dsa_metadata_selection as selection
from sglang_dsa_mtp.integration.fallback import Fallback, fallback_of
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA
from support.constants import POISON
from support.dsa_backends import metadata_tensors, poison
from support.metadata_cases import SMALL_TOPK, CapturedBuffers

MODES = {
    "decode": (ForwardMode.DECODE, "target"),
    "target verify": (ForwardMode.TARGET_VERIFY, "target"),
    "draft extend": (ForwardMode.DRAFT_EXTEND_V2, "draft_extend"),
}
CASE_OPS = {"decode": "decode", "target verify": "verify", "draft extend": "draft_extend"}
FAILING_BS = 4
ROUNDS = (([129, 0, 250], [3, 5, 1]), ([1, 300 - 5, 64], [2, 7, 6]))


class Raising:
    """One of our kernels, made to raise at ``FAILING_BS`` while ``armed``; records its calls."""

    def __init__(self, op, *, armed=True):
        self.kernel = {name: ours for _, ours, name in selection.KERNELS}[op]
        self.armed, self.calls = armed, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs["bs"])
        if self.armed and kwargs["bs"] == FAILING_BS:
            raise RuntimeError("injected failure")
        return self.kernel(**kwargs)


def build(server, hooked, op, *, raising=None, switch="1"):
    mode, kind = MODES[op]
    if raising is not None:
        kernels = tuple(
            (attr, raising if name == op else ours, name) for attr, ours, name in selection.KERNELS
        )
        hooked.setattr(selection, "KERNELS", kernels)
    hooked.setenv(BOUNDED_REPLAY_METADATA.env, switch)
    backend = getattr(server, kind)(FAILING_BS)
    hooked.delenv(BOUNDED_REPLAY_METADATA.env)
    hooked.setattr(selection, "KERNELS", selection.KERNELS)
    server.capture(backend, mode, [2, FAILING_BS])
    return backend


def replay_both(server, ours, sglang, op, bs, lengths, slots):
    mode, _ = MODES[op]
    for backend in (ours, sglang):
        poison(backend.decode_cuda_graph_metadata[bs], POISON)
        server.replay(backend, mode, lengths, slots, bs=bs)
    expected = metadata_tensors(sglang.decode_cuda_graph_metadata[bs])
    for name, tensor in metadata_tensors(ours.decode_cuda_graph_metadata[bs]).items():
        assert torch.equal(tensor, expected[name]), f"bs {bs}: {name} differs from SGLang's"


@pytest.mark.parametrize("op", list(MODES))
def test_a_raising_kernel_falls_back_to_sglangs_kernel_for_that_bs_only(
    dsa_server, hooked, caplog, op
):
    server = dsa_server()
    raising = Raising(op)
    sglang = build(server, hooked, op, switch="0")
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        ours = build(server, hooked, op, raising=raising)
        for lengths, slots in ROUNDS:
            replay_both(server, ours, sglang, op, FAILING_BS, lengths, slots)
            replay_both(server, ours, sglang, op, 2, lengths[:2], slots[:2])
    # bs 4 raised once, at its warm-up during capture, and went to SGLang's kernel for good;
    # bs 2 kept ours (its warm-up, then both replays).
    assert raising.calls == [FAILING_BS, 2, 2, 2]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert (
        f"DSA {op} replay metadata for bs {FAILING_BS} falls back to SGLang's kernel" in errors[0]
    )
    assert "RuntimeError: injected failure" in errors[0]


@pytest.mark.parametrize("op", list(MODES))
def test_a_kernel_raising_only_at_replay_falls_back_at_that_replay(dsa_server, hooked, caplog, op):
    """The warm-up at capture runs on twin buffers; a failure that only a replay meets falls back
    at that replay."""
    server = dsa_server()
    raising = Raising(op, armed=False)
    sglang = build(server, hooked, op, switch="0")
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        ours = build(server, hooked, op, raising=raising)
        raising.armed, raising.calls = True, []
        for lengths, slots in ROUNDS:
            replay_both(server, ours, sglang, op, FAILING_BS, lengths, slots)
    assert raising.calls == [FAILING_BS]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "injected failure" in errors[0]


def test_a_new_graph_state_drops_the_launches_bound_on_the_old_one(dsa_server, hooked):
    """A bound launch holds the buffers of the graph state it was bound on: SGLang building the
    graph state again drops it (each batch size is bound again at its capture)."""
    server = dsa_server()
    backend = build(server, hooked, "decode")
    fallback = fallback_of(backend._fused_decode_metadata)
    fallback.bound[2] = Bound()
    backend.init_cuda_graph_state(FAILING_BS, FAILING_BS)
    assert fallback.bound == {}


@pytest.mark.quick
def test_the_fallback_calls_sglangs_kernel_with_the_same_arguments():
    calls = []
    guarded = Fallback(
        lambda **kw: 1 / 0, lambda *a, **kw: calls.append((a, kw)) or "sglang", what="x"
    )
    assert guarded(bs=3, seq_lens="s") == "sglang"
    assert calls == [((), {"bs": 3, "seq_lens": "s"})]
    assert guarded.failed == {3}


@pytest.mark.quick
def test_the_fallback_calls_the_kernel_ours_names_now_with_the_callers_arguments():
    """``ours`` may be replaced (the serving loop counts and injects through it); positional
    arguments reach it too; a call by keyword is not changed on its way to SGLang's kernel."""
    calls = []
    guarded = Fallback(lambda **kw: calls.append(("first", kw)), lambda **kw: None, what="x")
    guarded.ours = lambda *a, **kw: calls.append(("second", a, kw))
    guarded(bs=3, seq_lens="s")
    guarded("p", bs=3)
    assert calls == [("second", (), {"bs": 3, "seq_lens": "s"}), ("second", ("p",), {"bs": 3})]
    sglang = []
    guarded = Fallback(lambda **kw: 1 / 0, lambda **kw: sglang.append(kw), what="x")
    guarded(bs=2, seq_lens="s")
    assert sglang == [{"bs": 2, "seq_lens": "s"}]


@pytest.mark.quick
def test_what_a_backend_attribute_holds_is_the_fallbacks_call_and_leads_back_to_it():
    guarded = Fallback(lambda **kw: 1 / 0, lambda **kw: ("sglang", kw), what="x")
    installed = guarded.installed
    assert installed(bs=3, seq_lens="s") == ("sglang", {"bs": 3, "seq_lens": "s"})
    assert fallback_of(installed) is guarded and guarded.failed == {3}
    assert fallback_of(guarded.sglang) is None and fallback_of(None) is None


class Bound:
    """A bound launch that takes the calls whose ``seq_lens`` is "s"; records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, kwargs) -> bool:
        self.calls.append(kwargs)
        return kwargs["seq_lens"] == "s"


@pytest.mark.quick
def test_a_call_the_launch_bound_for_its_bs_takes_launches_through_it_alone():
    ours = []
    guarded = Fallback(
        lambda **kw: ours.append(kw), lambda **kw: pytest.fail("fell back"), what="x"
    )
    bound = guarded.bound[3] = Bound()
    guarded.installed(bs=3, seq_lens="s")  # taken by the bound launch
    guarded.installed(bs=3, seq_lens="t")  # refused: ours
    guarded.installed(bs=4, seq_lens="s")  # no launch bound for bs 4: ours
    assert bound.calls == [{"bs": 3, "seq_lens": "s"}, {"bs": 3, "seq_lens": "t"}]
    assert ours == [{"bs": 3, "seq_lens": "t"}, {"bs": 4, "seq_lens": "s"}]


@pytest.mark.quick
def test_a_bound_launch_that_raises_sends_its_bs_to_sglangs_kernel_for_good():
    def raising(kwargs):
        raise RuntimeError("the launch failed")

    sglang = []
    guarded = Fallback(lambda **kw: pytest.fail("ours"), lambda **kw: sglang.append(kw), what="x")
    guarded.bound[3] = raising
    for _ in range(2):
        guarded.installed(bs=3, seq_lens="s")
    assert sglang == [{"bs": 3, "seq_lens": "s"}] * 2
    assert guarded.failed == {3} and guarded.bound == {}


@pytest.mark.parametrize("op", MODES)
def test_at_warm_up_on_the_cpu_nothing_is_bound_and_the_log_says_why(op, caplog, fresh_switches):
    """Triton's interpreter compiles nothing: every call goes through the wrapper (its JIT)."""
    ours = {name: kernel for _, kernel, name in selection.KERNELS}[op]
    guarded = Fallback(ours, lambda **kw: None, what=f"DSA {op} replay metadata")
    table = torch.zeros(4, 300, dtype=torch.int32)
    buffers = CapturedBuffers(table, max_bs=2, next_n=2, page_size=64, topk=SMALL_TOPK)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        guarded.warm_up(**buffers.replay_kwargs(CASE_OPS[op], 2))
    assert guarded.failed == set() and guarded.bound == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"sglang_dsa_mtp: DSA {op} replay metadata launches bound at capture: Triton's JIT: "
        "Triton compiles nothing here (its interpreter)"
    ]
