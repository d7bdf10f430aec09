"""Launches bound at capture write what SGLang's kernels write.

At the capture of a batch size the per-bs fallback (``integration/fallback.py``) binds the launch of
the replay call it will get, and the MTP one launch's capture binds its own (``launch.Binder.bind``);
SGLang's replays then pass the same buffers with new inputs. On the CPU (compiled kernels stood in
for, ``support.launch_stubs``): the call the server makes launches through the bound launch, and any
argument but the per-call inputs other than the bound one takes the wrapper. On the GPU, for decode,
target verify, draft extend and the MTP one launch, through Triton's real launchers (the probe run
on each): the same buffers are called again and again with new lengths and slots (also at an odd
input address, also inside a CUDA graph), whole buffers poisoned before each call, and after every
call every element of every buffer equals what SGLang's kernel leaves in its own buffers.
"""

import inspect

import pytest
import torch

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from support.constants import POISON
from support.launch_stubs import compiled_on_cpu
from support.metadata_cases import (
    SMALL_TOPK,
    CapturedBuffers,
    kernel_for,
    one_launch_kwargs,
)

BS = 6
ROUNDS = 5
WRAPPERS = {
    "decode": bounded.fused_dsa_decode_metadata_bounded,
    "verify": bounded.fused_dsa_target_verify_metadata_bounded,
    "draft_extend": bounded.fused_dsa_draft_extend_metadata_bounded,
    "mtp": draft.fused_dsa_draft_decode_metadata_multi,
}
INPUTS = ("seq_lens", "req_pool_indices", "extend_seq_lens")


def new_inputs(round_, req_to_token):
    gen = torch.Generator().manual_seed(round_)
    pool, width = req_to_token.shape
    lengths = torch.randint(0, width - 8, (BS + 1,), generator=gen)
    lengths[: round_ % 3] = torch.tensor([0, width - 5])[: round_ % 3]
    slots = torch.randint(0, pool, (BS + 1,), generator=gen)
    offset = round_ % 2  # odd rounds: inputs 8 bytes off a 16-byte boundary
    device = req_to_token.device
    return lengths.to(device)[offset : offset + BS], slots.to(device)[offset : offset + BS]


def buffers_of(kwargs: dict) -> list[torch.Tensor]:
    """Every output buffer of a call, the destinations' field by field."""
    out = []
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in INPUTS and name != "req_to_token":
            out.append(value)
        elif isinstance(value, list):
            out += [t for dest in value for t in dest if isinstance(t, torch.Tensor)]
    return out


def poison(kwargs: dict) -> None:
    for tensor in buffers_of(kwargs):
        tensor.fill_(POISON)


def assert_same(ours: dict, theirs: dict, what: str):
    for name, tensor in theirs.items():
        if isinstance(tensor, torch.Tensor) and name not in INPUTS:
            assert torch.equal(ours[name], tensor), f"{what}: {name} differs from SGLang's"


def served_kwargs(op: str, steps: list) -> dict:
    if op == "mtp":
        return one_launch_kwargs(steps, BS, steps[0].seq_lens[:BS], steps[0].req_pool_indices[:BS])
    return steps[0].replay_kwargs(op, BS)


# ------------------------------------------------------------------------------------------------
# CPU: the call the server makes, and what a bound launch takes
# ------------------------------------------------------------------------------------------------


def cpu_steps(op: str) -> list:
    table = torch.randint(0, 1000, (2 * BS, 300), dtype=torch.int32)
    next_n = 5 if op != "mtp" else 1
    steps = [
        CapturedBuffers(table, max_bs=BS, next_n=next_n, page_size=64, topk=SMALL_TOPK)
        for _ in range(3)
    ]
    steps[0].seq_lens.copy_(torch.arange(BS) * 40)
    steps[0].req_pool_indices.copy_(torch.arange(BS) + 1)
    return steps


@pytest.mark.quick
@pytest.mark.parametrize("op", WRAPPERS)
def test_the_call_the_server_makes_launches_through_the_launch_bound_at_capture(op, monkeypatch):
    """SGLang calls the backend attribute (the fallback's ``installed``) by keyword; the MTP one
    launch's replay calls the launch its capture bound. Both go through the bound launch; the
    wrapper itself always through Triton's JIT."""
    launches = []
    compiled_on_cpu(monkeypatch, launches)
    wrapper = WRAPPERS[op]
    kwargs = served_kwargs(op, cpu_steps(op))
    if op == "mtp":
        bound, _ = wrapper.binder.bind(**kwargs)

        def served():
            assert bound(kwargs)

    else:
        guarded = Fallback(wrapper, lambda **kw: pytest.fail(f"fell back: {kw}"), what=op)
        guarded.sglang = lambda **kw: None  # its warm-up only
        guarded.warm_up(**kwargs)
        guarded.sglang = lambda **kw: pytest.fail(f"fell back: {kw}")
        assert list(guarded.bound) == [BS]

        def served():
            guarded.installed(**kwargs)

    launches.clear()
    for _ in range(2):
        served()
    wrapper(**kwargs)
    what = wrapper.binder.what
    assert launches == [("bound", what), ("bound", what), ("jit", what)]


def _other(value):
    """A value a bound launch must tell from ``value``: another tensor, flag, int or list."""
    if isinstance(value, torch.Tensor) or value is None:
        return torch.zeros(1)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return list(value)  # the same destinations in another list


@pytest.mark.parametrize("op", WRAPPERS)
def test_every_argument_but_the_per_call_inputs_must_be_the_bound_one(op, monkeypatch):
    launches = []
    compiled_on_cpu(monkeypatch, launches)
    wrapper = WRAPPERS[op]
    kwargs = served_kwargs(op, cpu_steps(op))
    bound, _ = wrapper.binder.bind(**kwargs)
    launches.clear()
    for name in inspect.signature(wrapper).parameters:
        if name not in kwargs:
            continue
        if name in wrapper.binder.inputs:
            other = kwargs[name].clone()  # another tensor of the same layout: taken
            assert bound({**kwargs, name: other}), f"{op}: the input {name} is refused"
        else:
            assert not bound({**kwargs, name: _other(kwargs[name])}), f"{op}: {name} not checked"
    inputs = [name for name in wrapper.binder.inputs if name in kwargs]
    assert launches == [("bound", wrapper.binder.what)] * len(inputs)


# ------------------------------------------------------------------------------------------------
# GPU: launches bound through Triton's real launchers, against SGLang's kernels
# ------------------------------------------------------------------------------------------------


def bind(wrapper, kwargs):
    """The launch of ``kwargs`` bound, its probe run on the GPU's launchers: on the Triton releases
    whose C launch layout the C launch knows (3.6, 3.8), the probe must have chosen it."""
    bound, why = wrapper.binder.bind(**kwargs)
    assert bound is not None, why
    if launch.TRITON_VERSION.startswith(("3.6.", "3.8.")):
        assert bound.launcher == launch.C_LAUNCH, why
    return bound


def replay(bound, kwargs: dict, reference: dict, op: str, seq_lens, slots) -> dict:
    """One replay of each arm with these inputs, every output buffer of both poisoned first; returns
    the call's keyword arguments."""
    call = dict(kwargs, seq_lens=seq_lens, req_pool_indices=slots)
    reference.update(seq_lens=seq_lens, req_pool_indices=slots)
    poison(call)
    poison(reference)
    assert bound(call), "the bound launch refused the replay"
    kernel_for(op, "sglang")(**reference)
    torch.cuda.synchronize()
    return call


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_bound_launches_match_sglang(op, page_size, req_to_token_1m):
    ours, theirs = (
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=5, page_size=page_size, topk=2048)
        for _ in range(2)
    )
    kwargs = ours.replay_kwargs(op, BS)
    bound = bind(WRAPPERS[op], kwargs)
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(round_, req_to_token_1m)
        reference = theirs.replay_kwargs(op, BS)
        call = replay(bound, kwargs, reference, op, seq_lens, slots)
        assert_same(call, reference, f"round {round_}")


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_one_launch_bound_launches_match_sglang(steps, req_to_token_1m):
    ours = [
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=1, page_size=64, topk=2048)
        for _ in range(steps)
    ]
    theirs = CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=1, page_size=64, topk=2048)
    kwargs = one_launch_kwargs(ours, BS, ours[0].seq_lens[:BS], ours[0].req_pool_indices[:BS])
    bound = bind(draft.fused_dsa_draft_decode_metadata_multi, kwargs)
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(round_, req_to_token_1m)
        reference = theirs.replay_kwargs("decode", BS)
        replay(bound, kwargs, reference, "decode", seq_lens, slots)
        for i, step in enumerate(ours):
            assert_same(step.replay_kwargs("decode", BS), reference, f"round {round_}, step {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "verify", "draft_extend"])
def test_a_bound_launch_captured_in_a_cuda_graph_replays_like_sglang(op, req_to_token_1m):
    ours, theirs = (
        CapturedBuffers(req_to_token_1m, max_bs=BS, next_n=5, page_size=64, topk=2048)
        for _ in range(2)
    )
    kwargs = ours.replay_kwargs(op, BS)
    bound = bind(WRAPPERS[op], kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert bound(kwargs)
    for round_ in range(ROUNDS):
        seq_lens, slots = new_inputs(2 * round_, req_to_token_1m)  # aligned: the graph's inputs
        ours.seq_lens[:BS].copy_(seq_lens)
        ours.req_pool_indices[:BS].copy_(slots)
        poison(kwargs)
        graph.replay()
        reference = theirs.replay_kwargs(op, BS)
        reference.update(seq_lens=seq_lens, req_pool_indices=slots)
        poison(reference)
        kernel_for(op, "sglang")(**reference)
        torch.cuda.synchronize()
        assert_same(ours.replay_kwargs(op, BS), reference, f"replay {round_}")
