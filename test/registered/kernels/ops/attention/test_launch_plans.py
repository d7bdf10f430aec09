"""Calls through launch plans write what SGLang's kernels write.

A wrapper's first call with a set of buffers goes through Triton's JIT and keeps a launch plan; later
calls with those buffers launch through the plan (``kernels/ops/launch.py``). The plan's key is every
argument of the call but its per-call inputs (``LaunchPlans.key``): on the CPU, with plans made as on
a GPU (fixture ``planned_launches``), a call that differs in any other argument gets its own plan and
grid. On the GPU (under Triton's interpreter there are no plans), for decode, target verify, draft
extend and the MTP one launch: the same buffers are called again and again with new lengths and slots
(also at an odd input address, also inside a CUDA graph), and after every call every element of
every buffer equals what SGLang's kernel leaves in its own buffers through the same sequence of calls.
"""

import inspect

import pytest
import torch

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_common as common
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_common import bounded_num_programs
from sglang_dsa_mtp.kernels.ops.launch import LaunchPlans, bind
from support.metadata_cases import (
    SMALL_TOPK,
    STRIDING_LENGTHS,
    STRIDING_WIDTH,
    CapturedBuffers,
    kernel_for,
    make_case,
    one_launch_kwargs,
    run_draft_decode_multi,
)

BS = 6
ROUNDS = 5


@pytest.fixture
def plan_launches(monkeypatch):
    """Whether each call launched through a plan (True) or through Triton's JIT (False)."""
    launched = []
    real_call, real_launch = LaunchPlans.__call__, LaunchPlans.launch

    def call(self, arguments):
        launched.append(True)
        real_call(self, arguments)

    def jit(self, key, launch):
        launched[-1] = False
        real_launch(self, key, launch)

    monkeypatch.setattr(LaunchPlans, "__call__", call)
    monkeypatch.setattr(LaunchPlans, "launch", jit)
    return launched


def new_inputs(round_, req_to_token):
    gen = torch.Generator().manual_seed(round_)
    pool, width = req_to_token.shape
    lengths = torch.randint(0, width - 8, (BS + 1,), generator=gen)
    lengths[: round_ % 3] = torch.tensor([0, width - 5])[: round_ % 3]
    slots = torch.randint(0, pool, (BS + 1,), generator=gen)
    offset = round_ % 2  # odd rounds: inputs 8 bytes off a 16-byte boundary
    device = req_to_token.device
    return lengths.to(device)[offset : offset + BS], slots.to(device)[offset : offset + BS]


def assert_same(ours: dict, theirs: dict, what: str):
    for name, tensor in theirs.items():
        if isinstance(tensor, torch.Tensor) and name not in ("seq_lens", "req_pool_indices"):
            assert torch.equal(ours[name], tensor), f"{what}: {name} differs from SGLang's"


# ------------------------------------------------------------------------------------------------
# CPU: the plan key
# ------------------------------------------------------------------------------------------------

WRAPPERS = {
    "decode": (bounded._DECODE_PLANS, bounded.fused_dsa_decode_metadata_bounded),
    "verify": (bounded._VERIFY_PLANS, bounded.fused_dsa_target_verify_metadata_bounded),
    "draft_extend": (bounded._DRAFT_EXTEND_PLANS, bounded.fused_dsa_draft_extend_metadata_bounded),
    "mtp": (draft._PLANS, draft.fused_dsa_draft_decode_metadata_multi),
}


def _sample(parameter):
    """A value of ``parameter``'s annotated type: a tensor, a flag, an int, a destination list."""
    hint = str(parameter.annotation)
    if "Sequence" in hint:
        return [draft.DecodeMetadataDestination(*(torch.zeros(1) for _ in range(6)))]
    if "Tensor" in hint:
        return torch.zeros(1)
    return False if "bool" in hint else 3


def _other(value):
    """A value the key must tell from ``value``: another tensor, flag, int or destination list."""
    if isinstance(value, torch.Tensor) or value is None:
        return torch.zeros(1)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return [*value, draft.DecodeMetadataDestination(*(torch.zeros(1) for _ in range(6)))]


@pytest.mark.parametrize("op", WRAPPERS)
def test_every_argument_but_the_per_call_inputs_is_part_of_the_plan_key(op, monkeypatch):
    plans, wrapper = WRAPPERS[op]
    parameters = inspect.signature(wrapper).parameters
    arguments = {name: _sample(parameter) for name, parameter in parameters.items()}
    base = plans.key(arguments)
    assert plans.key(dict(arguments)) == base
    inputs = plans.kernel.arg_names[: plans.num_inputs]
    for name in parameters:
        changed = plans.key({**arguments, name: _other(arguments[name])})
        if name in inputs:
            assert changed == base, f"{op}: the per-call input {name} is in the key"
        else:
            assert changed != base, f"{op}: {name} is not in the key"
    monkeypatch.setattr(common, "TILE_N", 2 * common.TILE_N)
    assert plans.key(arguments) != base, f"{op}: the tile size is not in the key"


def _call(op, case, outs, budget):
    if op == "mtp":
        run_draft_decode_multi(case, outs, budget=budget)
    else:
        case.run("bounded", outs[0], budget=budget)


@pytest.mark.quick
@pytest.mark.parametrize("op", WRAPPERS)
def test_a_call_with_another_budget_on_the_same_buffers_launches_its_own_grid(op, planned_launches):
    """The same buffers called with budgets 2, 5, 2, 5: the first call of each budget compiles its
    grid (the JIT path), the second launches through that budget's own plan."""
    next_n = 2
    lengths = STRIDING_LENGTHS if op != "verify" else [n - next_n for n in STRIDING_LENGTHS]
    case = make_case(
        "decode" if op == "mtp" else op,
        lengths,
        width=STRIDING_WIDTH,
        device=torch.device("cpu"),
        topk=SMALL_TOPK,
        next_n=next_n,
        generator=torch.Generator().manual_seed(5),
    )
    outs = [case.outputs() for _ in range(3 if op == "mtp" else 1)]
    grid = {b: 1 + bounded_num_programs(case.bs, STRIDING_WIDTH, b) for b in (2, 5)}
    assert grid[2] != grid[5]
    for budget in (2, 5, 2, 5):
        _call(op, case, outs, budget)
    assert planned_launches == [
        ("jit", (grid[2],)),
        ("jit", (grid[5],)),
        ("plan", (grid[2],)),
        ("plan", (grid[5],)),
    ]


@pytest.mark.parametrize("op", WRAPPERS)
def test_the_call_the_server_makes_launches_through_the_wrappers_plan(op, planned_launches):
    """SGLang calls by keyword what the per-bs fallback installs: for the three ops a function with
    the wrapper's signature that launches through the plan of the call's key; the MTP one launch is
    the function its capture binds (``launch.bind``). The first call goes through the wrapper, its
    checks and the JIT; later ones, and the wrapper itself, take the plan."""
    plans, wrapper = WRAPPERS[op]
    table = torch.randint(0, 1000, (2 * BS, 300), dtype=torch.int32)
    next_n = 5 if op != "mtp" else 1
    steps = [
        CapturedBuffers(table, max_bs=BS, next_n=next_n, page_size=64, topk=SMALL_TOPK)
        for _ in range(3)
    ]
    if op == "mtp":
        kwargs = one_launch_kwargs(
            steps, BS, steps[0].seq_lens[:BS], steps[0].req_pool_indices[:BS]
        )
        inputs = [kwargs.pop(name) for name in plans.input_names]
        bound = bind(wrapper, plans.input_names, **kwargs)
        assert all(bound.fixed[name] is value for name, value in kwargs.items())

        def served():
            bound(*inputs)

        kwargs.update(zip(plans.input_names, inputs))
    else:
        kwargs = steps[0].replay_kwargs(op, BS)
        guarded = Fallback(wrapper, lambda **kw: pytest.fail(f"fell back: {kw}"), what=op)
        installed = guarded.installed
        assert installed.launch_plans is plans and installed.fallback is guarded
        assert list(inspect.signature(installed).parameters)[:-1] == list(
            inspect.signature(wrapper).parameters
        )

        def served():
            installed(**kwargs)

    for _ in range(2):
        served()
    wrapper(**kwargs)
    (kind, grid), *rest = planned_launches
    assert kind == "jit" and rest == [("plan", grid)] * 2


# ------------------------------------------------------------------------------------------------
# GPU: calls through plans against SGLang's kernels
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_calls_through_a_plan_match_sglang(op, page_size, req_to_token_1m, plan_launches):
    ours, theirs = (
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=5, page_size=page_size, topk=2048)
        for _ in range(2)
    )
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(round_, req_to_token_1m)
        for buffers, arm in ((ours, "bounded"), (theirs, "sglang")):
            kwargs = buffers.replay_kwargs(op, BS)
            kwargs.update(seq_lens=seq_lens, req_pool_indices=slots)
            kernel_for(op, arm)(**kwargs)
        torch.cuda.synchronize()
        assert_same(ours.replay_kwargs(op, BS), theirs.replay_kwargs(op, BS), f"round {round_}")
    assert plan_launches == [False] + [True] * (ROUNDS - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_one_launch_calls_through_a_plan_match_sglang(steps, req_to_token_1m, plan_launches):
    ours = [
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=1, page_size=64, topk=2048)
        for _ in range(steps)
    ]
    theirs = CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=1, page_size=64, topk=2048)
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(round_, req_to_token_1m)
        draft.fused_dsa_draft_decode_metadata_multi(**one_launch_kwargs(ours, BS, seq_lens, slots))
        kwargs = theirs.replay_kwargs("decode", BS)
        kwargs.update(seq_lens=seq_lens, req_pool_indices=slots)
        kernel_for("decode", "sglang")(**kwargs)
        torch.cuda.synchronize()
        for i, step in enumerate(ours):
            assert_same(step.replay_kwargs("decode", BS), kwargs, f"round {round_}, step {i}")
    assert plan_launches == [False] + [True] * (ROUNDS - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_a_plan_launch_captured_in_a_cuda_graph_replays_like_sglang(op, req_to_token_1m):
    ours, theirs = (
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=5, page_size=64, topk=2048)
        for _ in range(2)
    )
    kwargs = ours.replay_kwargs(op, BS)
    kernel_for(op, "bounded")(**kwargs)  # JIT path: keeps the plan
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel_for(op, "bounded")(**kwargs)  # through the plan, captured
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(2 * round_, req_to_token_1m)  # aligned: the graph's inputs
        ours.seq_lens[:BS].copy_(seq_lens)
        ours.req_pool_indices[:BS].copy_(slots)
        graph.replay()
        reference = theirs.replay_kwargs(op, BS)
        reference.update(seq_lens=seq_lens, req_pool_indices=slots)
        kernel_for(op, "sglang")(**reference)
        torch.cuda.synchronize()
        assert_same(ours.replay_kwargs(op, BS), reference, f"replay {round_}")
