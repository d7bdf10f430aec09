"""Launch plans: after its first call, a call key launches through the compiled kernel's launcher with
the arguments Triton's JIT passed it, and anything that could change Triton's choice takes the JIT path.

On the CPU the JIT and the compiled kernel are stand-ins that record what they get (Triton's
interpreter compiles nothing, so real plans exist only on a GPU: there the replay-metadata kernel
tests run every call twice, the second through the plan, against SGLang's kernels).
"""

import gc
import inspect
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.kernels.ops.launch import Launch, LaunchPlans, specialization_twin


class FakeCompiled:
    """What ``JITFunction.run`` returns on a GPU: a compiled kernel with a launcher (``run``)."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = "function", "packed", []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)

    def run(self, *args):
        self.launches.append(args)


class FakeKernel:
    """A ``@triton.jit`` function: ``kernel[grid](*args, **kwargs)`` records the call."""

    arg_names = ["seq_lens", "req_pool_indices", "out", "stride", "n", "BLOCK"]

    def __init__(self, compiled=True):
        self.compiled = FakeCompiled() if compiled else None
        self.jit_calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append(grid)  # (holds no argument: the JIT keeps none)
            return self.compiled

        return run


DRIVER = SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: 77)


def wrapper(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, out: torch.Tensor, n: int):
    """The signature the plans key: the kernel's two inputs, a buffer and a scalar."""


def make_plans(kernel, driver=DRIVER, prepared=None):
    """Plans of ``kernel`` for :func:`wrapper`, whose checks (``prepare``) append to ``prepared``."""

    def prepare(a):
        if prepared is not None:
            prepared.append(a["n"])
        for name in ("seq_lens", "req_pool_indices"):
            if not isinstance(a[name], torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor")
        arguments = dict(
            seq_lens=a["seq_lens"],
            req_pool_indices=a["req_pool_indices"],
            out=a["out"],
            stride=a["seq_lens"].stride(0),
            n=a["n"],
            BLOCK=4,
        )
        return Launch((1 + a["n"],), arguments, input_len=a["n"], options=dict(num_warps=4))

    return LaunchPlans(kernel, num_inputs=2, wrapper=wrapper, prepare=prepare, driver=driver)


def call(plans, out, seq_lens, req_pool_indices, n=3):
    """One call of the wrapper: through its key's plan, else checked and launched by the JIT."""
    plans(dict(seq_lens=seq_lens, req_pool_indices=req_pool_indices, out=out, n=n))


@pytest.fixture
def inputs():
    return torch.arange(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)


@pytest.mark.quick
def test_a_second_call_launches_through_the_plan_with_the_jit_arguments(inputs):
    prepared = []
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel, prepared=prepared)
    call(plans, out, *inputs)
    other = (torch.ones(5, dtype=torch.int64), torch.ones(6, dtype=torch.int64))
    call(plans, out, *other)
    assert len(kernel.jit_calls) == 1 and len(plans) == 1
    assert prepared == [3], "the plan's launch checked its arguments again"
    (launched,) = kernel.compiled.launches
    # No launch hook to call (Triton 3.8: empty hook chains): no hooks, no launch metadata.
    assert launched[:9] == (4, 1, 1, 77, "function", "packed", None, None, None)
    # Every parameter, in order, tensors by address: the new inputs, then the JIT call's others.
    assert launched[9:] == (other[0].data_ptr(), other[1].data_ptr(), out.data_ptr(), 1, 3, 4)


def test_with_a_launch_hook_the_plan_passes_the_hooks_and_the_kernels_launch_metadata(
    inputs, monkeypatch
):
    def enter(metadata):
        pass

    knobs = launch.triton.knobs.runtime
    monkeypatch.setattr(knobs, "launch_enter_hook", enter)
    monkeypatch.setattr(knobs, "launch_exit_hook", None)
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    for _ in range(2):
        call(plans, out, *inputs)
    (launched,) = kernel.compiled.launches
    assert launched[6:9] == (("metadata", (4, 1, 1)), enter, None)


def test_a_hook_added_to_triton_3_8s_chain_is_called_with_the_launch_metadata(inputs):
    """Triton 3.8 holds its launch hooks in chains: a hook added after the plan was made runs."""
    chain = launch.triton.knobs.runtime.launch_exit_hook
    if not hasattr(chain, "calls"):
        pytest.skip(f"Triton {launch.TRITON_VERSION} has no launch hook chains")
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    call(plans, out, *inputs)

    def exit_hook(metadata):
        pass

    chain.add(exit_hook)
    try:
        call(plans, out, *inputs)
    finally:
        chain.remove(exit_hook)
    (launched,) = kernel.compiled.launches
    assert launched[6:9] == (("metadata", (4, 1, 1)), None, chain)


@pytest.mark.parametrize(
    "change",
    [
        lambda s, r: (s.int(), r),
        lambda s, r: (s[::2], r),
        lambda s, r: (s[:2], r),
        lambda s, r: (s.view(2, 4), r),
    ],
    ids=["dtype", "stride", "too-short", "2-D"],
)
def test_inputs_the_plan_was_not_built_for_take_the_jit_path(inputs, change):
    prepared = []
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel, prepared=prepared)
    call(plans, out, *inputs)
    call(plans, out, *change(*inputs))
    assert len(kernel.jit_calls) == 2 and prepared == [3, 3]
    assert kernel.compiled.launches == []


def test_an_input_that_is_not_a_tensor_gets_the_checks_error_not_the_plan(inputs):
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    call(plans, out, *inputs)
    with pytest.raises(TypeError, match="req_pool_indices must be a torch.Tensor"):
        call(plans, out, inputs[0], "not a tensor")
    assert kernel.compiled.launches == []


def test_a_plan_is_dropped_when_one_of_its_buffers_is_freed(inputs):
    kernel = FakeKernel()
    plans = make_plans(kernel)
    out = torch.zeros(4, dtype=torch.int32)
    call(plans, out, *inputs)
    assert len(plans) == 1
    del out
    gc.collect()
    assert len(plans) == 0


def test_another_device_takes_the_jit_path(inputs):
    device = [-1]
    driver = SimpleNamespace(get_current_device=lambda: device[0], get_current_stream=lambda d: 0)
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel, driver)
    call(plans, out, *inputs)
    device[0] = 1
    call(plans, out, *inputs)
    assert len(kernel.jit_calls) == 2 and kernel.compiled.launches == []


def test_no_plan_without_a_compiled_kernel(inputs):
    """Triton's interpreter returns no compiled kernel: every call takes the JIT path."""
    kernel, out = FakeKernel(compiled=False), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    for _ in range(2):
        call(plans, out, *inputs)
    assert len(kernel.jit_calls) == 2 and len(plans) == 0


def test_a_triton_release_outside_the_known_launchers_takes_the_jit_path(inputs, monkeypatch):
    """The launcher's arguments are Triton's private interface: another release never gets a plan."""
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    for _ in range(2):
        call(plans, out, *inputs)
    assert len(kernel.jit_calls) == 2 and len(plans) == 0
    assert kernel.compiled.launches == []


@pytest.mark.parametrize(
    "version, direct",
    [
        ("3.3.1", False),
        ("3.4.0", True),
        ("3.5.1", True),
        ("3.6.0", True),
        ("3.7.0", True),
        ("3.8.0+git1234abcd", True),
        ("3.9.0", False),
        ("3.10.0", False),
        ("4.0.0", False),
    ],
)
def test_plans_launch_directly_on_triton_3_4_to_3_8_only(triton_release, version, direct):
    assert triton_release(version).DIRECT_LAUNCH is direct


def test_plans_past_the_cap_are_dropped_and_rebuilt(inputs, monkeypatch):
    monkeypatch.setattr(launch, "MAX_PLANS", 2)
    kernel = FakeKernel()
    plans = make_plans(kernel)
    outs = [torch.zeros(4, dtype=torch.int32) for _ in range(3)]
    for out in outs:
        call(plans, out, *inputs)
    assert len(plans) == 1
    call(plans, outs[2], *inputs)
    assert len(kernel.jit_calls) == 3 and len(kernel.compiled.launches) == 1


# ------------------------------------------------------------------------------------------------
# Specialization twins (the warm-up's buffers)
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


def test_a_shared_rows_twin_keeps_the_column_stride_in_one_row_of_storage():
    table = torch.full((50, 300), 7, dtype=torch.int32)[:, 1:]
    twin = specialization_twin(table, shared_rows=True)
    assert twin.shape == table.shape and twin.stride() == (0, 1)
    assert twin.data_ptr() % 16 == table.data_ptr() % 16
    assert twin.untyped_storage().nbytes() < 2 * 300 * 4
    twin[3, 5] = 1
    assert twin[0, 5] == 1 and (table == 7).all()


def test_plans_for_a_wrapper_without_the_kernel_inputs_are_an_error_naming_them():
    def wrapper(seq_lens: torch.Tensor, out: torch.Tensor, n: int):
        pass

    with pytest.raises(
        ValueError, match=r"no parameter for the kernel inputs \['req_pool_indices'\]"
    ):
        LaunchPlans(FakeKernel(), num_inputs=2, wrapper=wrapper)


def test_a_key_takes_tensors_by_identity_scalars_by_value_and_lists_item_by_item():
    def wrapper(
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        out: Optional[torch.Tensor],
        n: int,
        flag: bool,
        outs: Sequence[tuple],
    ):
        pass

    plans = LaunchPlans(FakeKernel(), num_inputs=2, wrapper=wrapper, tunables=lambda: (7,))
    out, other = torch.zeros(2), torch.zeros(2)
    arguments = dict(seq_lens=out, req_pool_indices=out, out=out, n=3, flag=True, outs=[(other,)])
    assert plans.key(arguments) == (3, True, id(out), (1, id(other)), 7)
    assert plans.key({**arguments, "seq_lens": other}) == plans.key(arguments)


# ------------------------------------------------------------------------------------------------
# What a plan reads at every launch
# ------------------------------------------------------------------------------------------------


def test_a_hook_set_after_the_plan_was_made_is_called_with_the_launch_metadata(inputs, monkeypatch):
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    call(plans, out, *inputs)  # the plan is made with no hook to call
    assert len(plans) == 1

    def enter(metadata):
        pass

    knobs = launch.triton.knobs.runtime
    monkeypatch.setattr(knobs, "launch_enter_hook", enter)
    call(plans, out, *inputs)
    monkeypatch.undo()
    call(plans, out, *inputs)
    with_hook, without = kernel.compiled.launches
    assert with_hook[6:8] == (("metadata", (4, 1, 1)), enter)
    assert without[6:9] == (None, None, None)


def test_the_current_stream_is_read_at_every_launch(inputs):
    stream = [5]
    driver = SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda d: stream[0])
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel, driver)
    call(plans, out, *inputs)
    for stream[0] in (6, 5, 9):
        call(plans, out, *inputs)
    assert [launched[3] for launched in kernel.compiled.launches] == [6, 5, 9]


def test_a_jit_call_with_inputs_that_are_not_1_d_keeps_no_plan():
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    inputs = (torch.zeros(8, 1, dtype=torch.int64), torch.zeros(8, dtype=torch.int64))
    for _ in range(2):
        call(plans, out, *inputs)
    assert len(kernel.jit_calls) == 2 and len(plans) == 0


def test_a_plan_launch_that_raises_raises_and_is_not_launched_again(inputs):
    """The inputs' checks passed: what raises is the launcher (or a hook), which Triton's JIT would
    call the same way; the error goes to the caller (the per-bs fallback)."""
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    plans = make_plans(kernel)
    call(plans, out, *inputs)

    def run(*args):
        raise RuntimeError("launch failed")

    kernel.compiled.run = run
    plans._plans[next(iter(plans._plans))].call = run
    with pytest.raises(RuntimeError, match="launch failed"):
        call(plans, out, *inputs)
    assert len(kernel.jit_calls) == 1


# ------------------------------------------------------------------------------------------------
# The C launch beneath Triton's CUDA launcher (``native_launch``)
# ------------------------------------------------------------------------------------------------


def cuda_launcher(recorded: list, *, scratch: int = 0):
    """Triton's own ``CudaLauncher`` (the installed release's class), made without compiling
    anything: its C ``launch`` records what it is given."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)
    launcher.num_ctas = 1
    launcher.global_scratch_size, launcher.global_scratch_align = scratch, 1
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    launcher.gsan_enabled = False
    launcher.arg_annotations, launcher.kernel_signature = ["annotations"], b"signature"
    launcher.launch = lambda *args: recorded.append(args)
    return launcher


def call_twice_through(launcher, inputs) -> tuple:
    """Two calls of one key, the compiled kernel's launcher ``launcher``: the second launches
    through the plan. Returns the kernel's arguments as the plan passes them."""
    kernel, out = FakeKernel(), torch.zeros(4, dtype=torch.int32)
    kernel.compiled.run = launcher
    plans = make_plans(kernel)
    for _ in range(2):
        call(plans, out, *inputs)
    return inputs[0].data_ptr(), inputs[1].data_ptr(), out.data_ptr(), 1, 3, 4


@pytest.mark.skipif(
    launch.TRITON_RELEASE != (3, 8), reason="compares with the installed Triton 3.8's launcher"
)
def test_on_triton_3_8_a_plan_gives_the_c_launch_what_the_launchers_call_gives_it(
    inputs, monkeypatch
):
    monkeypatch.setattr(launch.triton.runtime.driver, "_active", SimpleNamespace())
    by_plan, by_triton = [], []
    args = call_twice_through(cuda_launcher(by_plan), inputs)
    cuda_launcher(by_triton)(4, 1, 1, 77, "function", "packed", None, None, None, *args)
    assert by_plan == by_triton and len(by_plan) == 1
    assert by_plan[0][-1] == args  # (the kernel's arguments, one tuple)


def test_on_triton_3_6_a_plan_gives_the_c_launch_the_arguments_its_launcher_adds(
    inputs, monkeypatch
):
    """Triton 3.6's ``CudaLauncher.__call__(grid, stream, function, *args)`` calls ``launch(grid,
    stream, function, cooperative, pdl, global_scratch, profile_scratch, *args)`` (read in its
    source; the installed Triton may be another release, so the layout is written out)."""
    monkeypatch.setattr(launch, "TRITON_RELEASE", (3, 6))
    recorded = []
    args = call_twice_through(cuda_launcher(recorded), inputs)
    head = (4, 1, 1, 77, "function", False, True, None, None, "packed", None, None, None)
    assert recorded == [(*head, *args)]


@pytest.mark.parametrize("release, scratch", [((3, 7), 0), ((3, 8), 64), ((3, 6), 64)])
def test_another_release_or_a_kernel_with_scratch_memory_calls_the_launcher(
    inputs, monkeypatch, release, scratch
):
    """The launcher's ``__call__`` allocates scratch memory, and other releases' are not read."""
    monkeypatch.setattr(launch, "TRITON_RELEASE", release)
    native, called = [], []
    launcher = cuda_launcher(native, scratch=scratch)
    monkeypatch.setattr(type(launcher), "__call__", lambda self, *args: called.append(args))
    call_twice_through(launcher, inputs)
    assert native == [] and len(called) == 1
    assert called[0][:9] == (4, 1, 1, 77, "function", "packed", None, None, None)


def test_a_plan_asks_torch_for_the_current_device_without_its_lazy_init_check():
    """Triton's driver asks ``torch.cuda.current_device``, which checks CUDA's lazy initialization
    first; a plan exists only after a launch, so it asks ``torch._C._cuda_getDevice`` itself."""
    torch_driver = SimpleNamespace(get_current_device=torch.cuda.current_device)
    assert launch._current_device_getter(torch_driver) is torch._C._cuda_getDevice
    assert launch._current_device_getter(DRIVER) is DRIVER.get_current_device


# ------------------------------------------------------------------------------------------------
# The planned function (``LaunchPlans.planned``) and the bound call (``launch.bind``)
# ------------------------------------------------------------------------------------------------

_PLANNED = None  # the plans of planned_wrapper (fixture planned)
TUNED = {"tile": 1}  # the plans' tunable (as module constants are read: at every call)


def planned_wrapper(
    seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, out: torch.Tensor, bs: int = 3
):
    """A wrapper as ours are written: its body is its plans' call of its locals()."""
    _PLANNED(locals())


@pytest.fixture
def planned(monkeypatch):
    """(the plans of planned_wrapper, its kernel, the bs each check saw, the misses of a planned
    function, that function: its misses call the wrapper; a bs of 7 is sent to them)."""
    prepared, misses = [], []
    kernel = FakeKernel()

    def prepare(a):
        prepared.append(a["bs"])
        return make_plans(kernel).prepare({**a, "n": a["bs"]})

    plans = LaunchPlans(
        kernel,
        num_inputs=2,
        wrapper=planned_wrapper,
        prepare=prepare,
        tunables=lambda: (TUNED["tile"],),
        driver=DRIVER,
    )
    monkeypatch.setitem(globals(), "_PLANNED", plans)

    def on_miss(rest, **arguments):
        misses.append((rest, arguments))
        given = {k: v for k, v in arguments.items() if v is not launch.MISSING}
        return planned_wrapper(**given, **rest)

    return plans, kernel, prepared, misses, plans.planned(on_miss, unless={7})


def test_a_planned_function_launches_through_the_plan_of_its_parameters_key(inputs, planned):
    plans, kernel, prepared, misses, function = planned
    out = torch.zeros(4, dtype=torch.int32)
    kwargs = dict(seq_lens=inputs[0], req_pool_indices=inputs[1], out=out)
    function(**kwargs)  # no plan yet: on_miss, the wrapper, its checks and the JIT
    function(**kwargs)  # through the plan
    function(inputs[0], inputs[1], out)  # by position: the same key
    planned_wrapper(**kwargs)  # the wrapper finds the same plan
    function(**kwargs, bs=5)  # another bs: another key, checked
    assert prepared == [3, 5] and len(plans) == 2 and len(misses) == 2
    assert [launched[0] for launched in kernel.compiled.launches] == [4, 4, 4]
    assert function.launch_plans is plans and function.__doc__ == planned_wrapper.__doc__
    parameters = list(inspect.signature(function).parameters)
    assert parameters == ["seq_lens", "req_pool_indices", "out", "bs", "rest"]


@pytest.mark.parametrize(
    "change",
    [
        lambda kw: kw.update(m=1),  # a keyword the wrapper does not have
        lambda kw: kw.update(bs=7),  # a bs in unless
        lambda kw: kw.pop("out"),  # a required argument left out: MISSING
        lambda kw: kw.update(seq_lens="not a tensor"),  # inputs the plan does not take
        lambda kw: kw.update(out=torch.zeros(4)),  # another buffer: another key
    ],
    ids=["unknown-keyword", "unless", "missing", "not-a-tensor", "other-buffer"],
)
def test_a_call_no_plan_takes_goes_to_on_miss_with_its_arguments(inputs, planned, change):
    plans, kernel, _, misses, function = planned
    out = torch.zeros(4, dtype=torch.int32)
    kwargs = dict(seq_lens=inputs[0], req_pool_indices=inputs[1], out=out)
    function(**kwargs)  # keeps the plan
    misses.clear()
    change(kwargs)
    try:
        function(**kwargs)
    except (TypeError, KeyError):
        pass  # the wrapper's binding or checks, from on_miss
    ((rest, arguments),) = misses
    assert rest == ({"m": 1} if "m" in kwargs else {})
    for name in ("seq_lens", "req_pool_indices", "out"):
        assert arguments[name] is kwargs.get(name, launch.MISSING), name
    assert kernel.compiled.launches == []


def test_a_planned_function_meeting_an_error_goes_to_on_miss(inputs, planned):
    plans, kernel, _, misses, function = planned
    out = torch.zeros(4, dtype=torch.int32)
    function(inputs[0], inputs[1], out)
    (plan,) = plans._plans.values()
    plan.call = None  # the launch raises TypeError
    misses.clear()
    with pytest.raises(TypeError):
        function(inputs[0], inputs[1], out)  # on_miss meets the same error
    assert len(misses) == 1


def test_set_unless_every_sends_every_call_to_on_miss(inputs, planned):
    plans, kernel, _, misses, function = planned
    out = torch.zeros(4, dtype=torch.int32)
    function(inputs[0], inputs[1], out)
    launch.set_unless(function, launch.EVERY)
    function(inputs[0], inputs[1], out)
    launch.set_unless(function, ())
    function(inputs[0], inputs[1], out)
    assert len(misses) == 2 and len(kernel.compiled.launches) == 2  # the wrapper's, the plan's


def test_only_a_wrapper_whose_body_is_its_plans_call_gets_a_planned_function():
    plans = make_plans(FakeKernel())  # plans of wrapper, whose body is its docstring
    assert plans.planned(lambda rest, **a: None) is None


def test_a_bound_call_launches_through_the_plan_of_its_fixed_arguments(
    inputs, planned, monkeypatch
):
    plans, kernel, prepared, _, _ = planned
    out = torch.zeros(4, dtype=torch.int32)
    bound = launch.bind(planned_wrapper, ("seq_lens", "req_pool_indices"), out=out)
    bound(*inputs)  # no plan: the wrapper's call, checked, JIT
    bound(*inputs)  # the plan
    planned_wrapper(inputs[0], inputs[1], out)  # the same key
    assert prepared == [3] and len(kernel.compiled.launches) == 2
    monkeypatch.setitem(TUNED, "tile", 2)  # read at every call: another key
    bound(*inputs)
    assert prepared == [3, 3]


def test_binding_another_function_is_a_plain_call_by_keyword():
    calls = []

    def other(**kwargs):
        calls.append(kwargs)

    launch.bind(other, ("a", "b"), c=3)(1, 2)
    assert calls == [{"a": 1, "b": 2, "c": 3}]
