"""Launches bound at capture: each input at the parameter of its name, the launcher chosen by a probe,
and a later call launched only with the bound buffers.

On the CPU Triton's interpreter compiles nothing: ``support.launch_stubs`` stands in a compiled kernel
whose launch runs the interpreted kernel with its arguments by parameter position, so binding, the
checks before a launch and the probe run as on a GPU (where ``attention/test_launch_plans.py`` binds
every op through Triton's real launchers and compares with SGLang's kernels).
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_dsa_mtp import log
from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.launch import (
    C_LAUNCH,
    JIT,
    TRITON_LAUNCH,
    BoundLaunch,
    specialization_twin,
)
from support.constants import POISON
from support.launch_stubs import compiled_on_cpu
from support.metadata_cases import SMALL_TOPK, CapturedBuffers, kernel_for

BS = 3
WRAPPERS = {
    "decode": bounded.fused_dsa_decode_metadata_bounded,
    "verify": bounded.fused_dsa_target_verify_metadata_bounded,
    "draft_extend": bounded.fused_dsa_draft_extend_metadata_bounded,
}
OPS = list(WRAPPERS)
TABLE = torch.randint(
    0, 1000, (8, 300), dtype=torch.int32, generator=torch.Generator().manual_seed(3)
)


@pytest.fixture
def launches(monkeypatch):
    """Every launch of the four wrappers' kernels, ``(kind, op)``, kind "jit" or "bound"; the log's
    once-per-process memory empty."""
    recorded = []
    compiled_on_cpu(monkeypatch, recorded)
    monkeypatch.setattr(log, "_seen", set())
    return recorded


def captured(round_: int = 0) -> CapturedBuffers:
    """One backend's graph buffers, its inputs holding round ``round_``'s lengths and slots."""
    buffers = CapturedBuffers(TABLE, max_bs=4, next_n=2, page_size=64, topk=SMALL_TOPK)
    set_inputs(buffers, round_)
    return buffers


def set_inputs(buffers: CapturedBuffers, round_: int) -> None:
    gen = torch.Generator().manual_seed(100 + round_)
    buffers.seq_lens.copy_(torch.randint(0, 298, (4,), generator=gen))
    buffers.req_pool_indices.copy_(torch.randint(0, 8, (4,), generator=gen))


def outputs(kwargs: dict) -> dict:
    inputs = ("seq_lens", "req_pool_indices", "extend_seq_lens", "req_to_token")
    return {
        n: t.clone() for n, t in kwargs.items() if isinstance(t, torch.Tensor) and n not in inputs
    }


def sglang_outputs(op: str, kwargs: dict) -> dict:
    """What SGLang's kernel writes for ``kwargs``, into poisoned copies of its output buffers."""
    copies = {n: t.clone().fill_(POISON) for n, t in outputs(kwargs).items()}
    theirs = {n: v for n, v in kwargs.items() if n != "budget"}  # ours only
    kernel_for(op, "sglang")(**{**theirs, **copies})
    return copies


def poison(kwargs: dict) -> None:
    for tensor in outputs(kwargs):
        kwargs[tensor].fill_(POISON)


def assert_outputs(kwargs: dict, expected: dict, what: str) -> None:
    for name, tensor in expected.items():
        if name != "real_page_table" or kwargs["physical_page_size"] > 1:
            assert torch.equal(kwargs[name], tensor), f"{what}: {name} differs"


# ------------------------------------------------------------------------------------------------
# Binding and the launches through a bound launch
# ------------------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("op", OPS)
def test_a_bound_launch_launches_later_calls_with_its_buffers_as_sglangs_kernel_writes(
    op, launches
):
    buffers = captured()
    kwargs = buffers.replay_kwargs(op, BS)
    bound, why = WRAPPERS[op].binder.bind(**kwargs)
    assert bound is not None and bound.launcher == TRITON_LAUNCH
    assert why.startswith(f"{TRITON_LAUNCH}: {C_LAUNCH} not chosen (LookupError") and why.endswith(
        "the probe matched"
    )
    what = WRAPPERS[op].binder.what
    assert launches == [("bound", what), ("jit", what)]  # the probe's, on twin buffers
    launches.clear()
    for round_ in range(1, 3):
        set_inputs(buffers, round_)
        expected = sglang_outputs(op, kwargs)
        poison(kwargs)
        assert bound(kwargs)
        assert_outputs(kwargs, expected, f"round {round_}")
    assert launches == [("bound", what)] * 2


@pytest.mark.parametrize("op", OPS)
def test_inputs_placed_at_other_parameters_are_refused_before_any_launch(op, launches, monkeypatch):
    """The check before any launch: a planted mapping that places the inputs in reverse order."""

    def reversed_slots(arg_names, inputs):
        return tuple(zip(inputs, reversed([arg_names.index(name) for name in inputs])))

    monkeypatch.setattr(launch, "input_slots", reversed_slots)
    bound, why = WRAPPERS[op].binder.bind(**captured().replay_kwargs(op, BS))
    assert bound is None and why.startswith(f"{JIT}: the input seq_lens would be placed at the")
    assert launches == []


@pytest.mark.parametrize("op", OPS)
def test_a_launch_binding_its_inputs_in_reverse_order_fails_the_probe_and_the_wrapper_serves(
    op, launches, monkeypatch, caplog
):
    """A planted bound launch that places its inputs in reverse order past the check: the probe's
    outputs differ from Triton's JIT for every launcher, so nothing is bound, the Fallback logs why
    and its calls go through the wrapper, writing what SGLang's kernel writes."""
    init = BoundLaunch.__init__

    def reversed_init(self, binder, kwargs, bound_launch, slots, launcher):
        names, positions = zip(*slots)
        init(self, binder, kwargs, bound_launch, tuple(zip(names, positions[::-1])), launcher)

    monkeypatch.setattr(BoundLaunch, "__init__", reversed_init)
    buffers = captured()
    kwargs = buffers.replay_kwargs(op, BS)
    guarded = Fallback(WRAPPERS[op], lambda **kw: None, what=op)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        guarded.warm_up(**kwargs)
    assert guarded.bound == {} and guarded.failed == set()
    (line,) = [r.getMessage() for r in caplog.records]
    assert caplog.records[0].levelno == logging.INFO
    assert f"{op} launches bound at capture: {JIT}: {C_LAUNCH} not chosen" in line
    assert f"{TRITON_LAUNCH} not chosen (cache_seqlens differs from Triton's JIT)" in line
    what = WRAPPERS[op].binder.what
    launches.clear()
    expected = sglang_outputs(op, kwargs)
    poison(kwargs)
    guarded(**kwargs)
    assert launches == [("jit", what)]
    assert_outputs(kwargs, expected, "through the wrapper")


def _writes_nothing(compiled, grid):
    return lambda arguments: None


def _swaps_the_first_two_arguments(compiled, grid):
    real = launch.triton_launch(compiled, grid)
    return lambda arguments: real([arguments[1], arguments[0], *arguments[2:]])


def _raises(compiled, grid):
    def launch_(arguments):
        raise RuntimeError("the C launch failed")

    return launch_


@pytest.mark.parametrize(
    "fake, why",
    [
        (_writes_nothing, "cache_seqlens differs from Triton's JIT"),
        (_swaps_the_first_two_arguments, "cache_seqlens differs from Triton's JIT"),
        (_raises, "RuntimeError: the C launch failed"),
    ],
    ids=["writes-nothing", "inputs-swapped", "raises"],
)
def test_a_c_launch_that_writes_otherwise_than_the_jit_is_not_chosen(
    fake, why, launches, monkeypatch, caplog
):
    """The probe's mismatch branch: Triton's own launch is bound instead, and the log says why,
    once."""
    monkeypatch.setattr(launch, "LAUNCHERS", ((C_LAUNCH, fake), launch.LAUNCHERS[1]))
    guarded = Fallback(WRAPPERS["decode"], lambda **kw: None, what="decode")
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        for bs in (BS, BS):
            guarded.warm_up(**captured().replay_kwargs("decode", bs))
    assert guarded.bound[BS].launcher == TRITON_LAUNCH
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{TRITON_LAUNCH}: {C_LAUNCH} not chosen ({why}); the probe matched" in line


def test_a_c_launch_that_writes_what_the_jit_writes_is_chosen(launches, monkeypatch):
    monkeypatch.setattr(launch, "LAUNCHERS", ((C_LAUNCH, launch.triton_launch), *launch.LAUNCHERS))
    bound, why = WRAPPERS["decode"].binder.bind(**captured().replay_kwargs("decode", BS))
    assert bound.launcher == C_LAUNCH and why == f"{C_LAUNCH}: the probe matched"


@pytest.mark.parametrize("op", OPS)
def test_the_probe_inputs_differ_from_each_other_in_every_entry_and_stay_in_range(op):
    kwargs = captured().replay_kwargs(op, BS)
    binder = WRAPPERS[op].binder
    prepared = binder.prepare(binder.arguments(kwargs))
    inputs = launch.probe_inputs(binder, kwargs, prepared)
    assert set(inputs) == {"seq_lens", "req_pool_indices"}
    seq, slots = inputs["seq_lens"], inputs["req_pool_indices"]
    limit = min(TABLE.shape[0], kwargs.get("max_len", kwargs.get("max_seqlen_k")))
    assert (seq != slots).all() and (seq >= 0).all() and (slots >= 0).all()
    assert (seq < limit).all() and (slots < limit).all()
    if "extend_seq_lens" in kwargs:
        extend = kwargs["extend_seq_lens"]
        assert (seq[:BS] != extend).all() and (slots[:BS] != extend).all()
    for name, tensor in inputs.items():
        assert (tensor.dtype, tensor.stride()) == (kwargs[name].dtype, kwargs[name].stride())


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (lambda: captured().replay_kwargs("decode", 0), f"{JIT}: the call needs no kernel"),
        (
            lambda: captured().replay_kwargs("decode", BS),
            f"{JIT}: Triton compiles nothing here (its interpreter)",
        ),
    ],
    ids=["bs-0", "interpreter"],
)
def test_a_call_without_a_compiled_kernel_binds_nothing(kwargs, why):
    assert WRAPPERS["decode"].binder.bind(**kwargs()) == (None, why)


def test_binding_inside_a_cuda_stream_capture_is_refused(launches, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        WRAPPERS["decode"].binder.bind(**captured().replay_kwargs("decode", BS))
    assert launches == []


def test_a_wrapper_without_a_parameter_for_a_kernel_input_is_an_error_naming_it():
    def wrapper(seq_lens, out, bs):
        """No req_pool_indices."""

    kernel = SimpleNamespace(arg_names=["seq_lens", "req_pool_indices", "out"])
    with pytest.raises(ValueError, match=r"wrapper has no parameter for the kernel inputs \['req"):
        launch.Binder("x", kernel, 2, lambda a: None, wrapper)


# ------------------------------------------------------------------------------------------------
# What a bound launch takes: the bound buffers and scalars, inputs of the bound layout
# ------------------------------------------------------------------------------------------------


def _changes(kwargs: dict) -> dict:
    seq_lens = kwargs["seq_lens"]
    return {
        "another tensor": {"cache_seqlens": kwargs["cache_seqlens"].clone()},
        "another scalar": {"dsa_index_topk": kwargs["dsa_index_topk"] + 1},
        "a scalar of another type": {"physical_page_size": float(kwargs["physical_page_size"])},
        "input of another dtype": {"seq_lens": seq_lens.to(torch.int32)},
        "input with another stride": {"seq_lens": seq_lens.repeat_interleave(2)[::2]},
        "input too short": {"seq_lens": seq_lens[: BS - 1]},
        "input not a tensor": {"seq_lens": seq_lens.tolist()},
        "another keyword": {"budget": None},
    }


@pytest.mark.parametrize("change", list(_changes(captured().replay_kwargs("decode", BS))))
def test_a_call_with_other_arguments_launches_nothing_bound_and_the_wrapper_takes_it(
    change, launches
):
    buffers = captured()
    kwargs = buffers.replay_kwargs("decode", BS)
    guarded = Fallback(WRAPPERS["decode"], lambda **kw: ("sglang", kw), what="decode")
    guarded.warm_up(**kwargs)
    changed = {**kwargs, **_changes(kwargs)[change]}
    launches.clear()
    assert not guarded.bound[BS](changed) and launches == []
    if change in ("input too short", "input not a tensor", "a scalar of another type"):
        assert guarded(**changed)[0] == "sglang"  # the wrapper's checks raise: SGLang's kernel
        assert launches == [] and guarded.failed == {BS}
        return
    expected = sglang_outputs("decode", changed)
    poison(changed)
    assert guarded(**changed) is None
    assert launches == [("jit", "decode")]
    assert_outputs(changed, expected, change)
    launches.clear()
    guarded(**kwargs)  # the bound buffers again
    assert launches == [("bound", "decode")]


# ------------------------------------------------------------------------------------------------
# The C launch beneath Triton's CUDA launcher
# ------------------------------------------------------------------------------------------------


def cuda_launcher(recorded: list, *, scratch: int = 0, layout: str = "3.8"):
    """Triton's own ``CudaLauncher`` class (the installed release's), made without compiling
    anything: its C ``launch`` records what it is given; ``layout`` "3.6" without the attributes
    Triton 3.8 added."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)
    launcher.num_ctas = 1
    launcher.global_scratch_size, launcher.global_scratch_align = scratch, 1
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    launcher.gsan_enabled = False
    if layout == "3.8":
        launcher.arg_annotations, launcher.kernel_signature = ["annotations"], b"signature"
    launcher.launch = lambda *args: recorded.append(args)
    return launcher


class FakeCompiled:
    """A compiled kernel with the launcher ``run``; ``compiled[grid]`` records a launch."""

    function, packed_metadata = "function", "packed"

    def __init__(self, run):
        self.run, self.launches = run, []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


@pytest.fixture
def cuda_driver(monkeypatch):
    """Triton's active driver and the current device, as on device 0 with stream 77."""
    driver = SimpleNamespace(get_current_stream=lambda device: 77 + device)
    monkeypatch.setattr(launch.triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)


ARGS = ["seq_lens", "req_pool_indices", 16, 3]


@pytest.mark.skipif(
    not launch.TRITON_VERSION.startswith("3.8."), reason="compares with Triton 3.8's launcher"
)
def test_the_c_launch_gets_what_triton_3_8s_launcher_gives_it(cuda_driver):
    by_c, by_triton = [], []
    launch.c_launch(FakeCompiled(cuda_launcher(by_c)), (4, 1, 1))(ARGS)
    cuda_launcher(by_triton)(4, 1, 1, 77, "function", "packed", None, None, None, *ARGS)
    assert by_c == by_triton and by_c[0][-1] == tuple(ARGS)


def test_the_c_launch_of_triton_3_6s_layout_gets_the_arguments_its_launcher_adds(cuda_driver):
    """Triton 3.6's ``CudaLauncher.__call__(grid, stream, function, *args)`` calls ``launch(grid,
    stream, function, cooperative, pdl, global_scratch, profile_scratch, *args)`` (read in its
    source; the installed Triton may be another release, so the layout is written out)."""
    recorded = []
    launch.c_launch(FakeCompiled(cuda_launcher(recorded, layout="3.6")), (4, 1, 1))(ARGS)
    head = (4, 1, 1, 77, "function", False, True, None, None, "packed", None, None, None)
    assert recorded == [(*head, *ARGS)]


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: cuda_launcher([], scratch=64), "allocates memory per launch"),
        (lambda: SimpleNamespace(), "the launcher is a SimpleNamespace, not Triton's CudaLauncher"),
    ],
    ids=["scratch-memory", "another-launcher"],
)
def test_no_c_launch_is_made_of_a_launcher_that_allocates_or_is_not_tritons(make, why, cuda_driver):
    with pytest.raises(LookupError, match=why):
        launch.c_launch(FakeCompiled(make()), (4, 1, 1))


@pytest.mark.parametrize("hook", ["launch_enter_hook", "launch_exit_hook"], ids=["enter", "exit"])
def test_while_a_launch_hook_is_set_the_c_launch_goes_through_tritons_launch(
    hook, cuda_driver, monkeypatch
):
    """Either hook: the C launch passes Triton's launcher no hooks, so it would skip the one set."""
    recorded = []
    compiled = FakeCompiled(cuda_launcher(recorded))
    c_launch = launch.c_launch(compiled, (4, 1, 1))
    monkeypatch.setattr(launch.triton.knobs.runtime, hook, lambda metadata: None)
    c_launch(ARGS)
    assert recorded == [] and compiled.launches == [((4, 1, 1), tuple(ARGS))]


# ------------------------------------------------------------------------------------------------
# Twin buffers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.int32),
        lambda: torch.arange(12, dtype=torch.int32)[1:],
        lambda: torch.arange(12, dtype=torch.int64)[3:],
        lambda: torch.arange(60, dtype=torch.int32).view(6, 10)[1:, 2:7],
        lambda: torch.arange(60, dtype=torch.int32).view(6, 10).t(),
        lambda: torch.zeros(0, 5, dtype=torch.int32),
    ],
    ids=["1-D", "offset-4-bytes", "offset-int64", "2-D-strided-offset", "transposed", "empty"],
)
def test_a_twin_matches_dtype_shape_strides_and_alignment(make):
    tensor = make()
    twin = specialization_twin(tensor)
    assert (twin.dtype, twin.shape, twin.stride()) == (tensor.dtype, tensor.shape, tensor.stride())
    assert twin.data_ptr() % 16 == tensor.data_ptr() % 16
    assert twin.data_ptr() != tensor.data_ptr() or tensor.numel() == 0
    assert not twin.any()


@pytest.mark.parametrize("row_stride", [0, 40])
def test_a_twin_with_another_row_stride_keeps_the_column_stride_and_alignment(row_stride):
    table = torch.full((50, 300), 7, dtype=torch.int32)[:, 1:]
    twin = specialization_twin(table, row_stride=row_stride)
    assert twin.shape == table.shape and twin.stride() == (row_stride, 1)
    assert twin.data_ptr() % 16 == table.data_ptr() % 16
    assert twin.untyped_storage().nbytes() < (49 * row_stride + 2 * 300) * 4
    twin[3, 5] = 1
    assert twin[0, 5 + 3 * row_stride] == 1 and (table == 7).all()
