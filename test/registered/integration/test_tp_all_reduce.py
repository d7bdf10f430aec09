"""Which implementation SGLang's TP all-reduce would use for the exchange buffer inside a capture.

The predicted route is checked against SGLang's own dispatch: a ``GroupCoordinator`` (its real
class, registered in SGLang's group registry, its state set per case) runs its real ``all_reduce``
on the probe, and the communicator it calls is the route. Its communicators are stand-ins with
SGLang's method names: what each one says about the probe (eligible or not) is set per case, and each
records the call it gets. The probe stands in for a CUDA tensor. The last test pins the private names
of SGLang 0.5.23's custom all-reduce V2 that the prediction reads.
"""

import contextlib
import inspect
import itertools
from types import SimpleNamespace

import pytest

from support.sglang_import import require_sglang

require_sglang()

import torch
from sglang.srt.distributed import parallel_state
from sglang.srt.distributed.parallel_state import GroupCoordinator

from sglang_dsa_mtp.integration.vocab_shard_exchange import all_reduce_route

PROBE = SimpleNamespace(is_cpu=False, is_cuda=True, numel=lambda: 16 * 152, element_size=lambda: 4)
PROBE.is_contiguous = lambda: True
PROBE.device = SimpleNamespace(type="cuda")

# The communicator SGLang's all_reduce called, as all_reduce_route names the route.
ROUTE_OF_CALL = {
    "ca_comm.custom_all_reduce": "custom all-reduce (Communicator)",
    "pcie_ipc_comm.pcie_ipc_all_reduce": "PCIe IPC all-reduce",
    "qr_comm.quick_all_reduce": "quick all-reduce",
    "pymscclpp_comm.all_reduce": "MSCCL++",
    "torch_symm_mem_comm.all_reduce": "torch symmetric memory",
    "pynccl_comm.all_reduce (change_state enable)": "pynccl with symmetric memory (--enable-symm-mem)",
    "pynccl_comm.outplace_all_reduce (change_state enable)": "pynccl out of place",
    "pynccl_comm.all_reduce": "pynccl (in place)",
    "flashinfer_allreduce": "FlashInfer all-reduce",
    "torch.distributed.all_reduce": "torch.distributed (NCCL)",
}
NCCL_CALLS = {call for call in ROUTE_OF_CALL if call.startswith(("pynccl", "torch.distributed"))}
# Each out-of-place communicator's eligibility check, by the group field that holds it.
CHECKS = {
    "ca_comm": "should_custom_ar",
    "pcie_ipc_comm": "should_pcie_ipc_ar",
    "qr_comm": "should_quick_allreduce",
    "pymscclpp_comm": "should_mscclpp_allreduce",
    "torch_symm_mem_comm": "should_torch_symm_mem_allreduce",
}


class Communicator:
    """A device communicator stand-in: enabled, ``eligible`` for every tensor (its SGLang check),
    every all-reduce method records ``<field>.<method>`` and returns the tensor."""

    def __init__(self, field: str, calls: list, eligible: bool = True):
        self.field, self.calls, self.disabled, self.state = field, calls, False, ""
        if field in CHECKS:
            setattr(self, CHECKS[field], lambda tensor: eligible)

    def _record(self, method, tensor):
        self.calls.append(f"{self.field}.{method}{self.state}")
        return tensor

    def custom_all_reduce(self, tensor):
        return self._record("custom_all_reduce", tensor)

    def pcie_ipc_all_reduce(self, tensor):
        return self._record("pcie_ipc_all_reduce", tensor)

    def quick_all_reduce(self, tensor):
        return self._record("quick_all_reduce", tensor)

    def all_reduce(self, tensor, **kwargs):
        return self._record("all_reduce", tensor)

    def outplace_all_reduce(self, tensor):
        return self._record("outplace_all_reduce", tensor)

    @contextlib.contextmanager
    def change_state(self, enable):
        self.state = f" (change_state {'enable' if enable else 'disable'})"
        try:
            yield
        finally:
            self.state = ""


def sglang_coordinator(monkeypatch, calls, *, symm_mem=False, flashinfer=False, **comms):
    """SGLang's ``GroupCoordinator`` of two ranks holding ``comms``, in SGLang's group registry,
    with ``torch.distributed.all_reduce`` recorded instead of run."""
    group = object.__new__(GroupCoordinator)
    fields = dict(
        world_size=2,
        unique_name=f"route-check:{len(calls)}:{id(group)}",
        device_group=object(),
        cpu_group=None,
        hpu_communicator=None,
        xpu_communicator=None,
        ca_comm=None,
        pynccl_comm=None,
        pymscclpp_comm=None,
        pcie_ipc_comm=None,
        qr_comm=None,
        torch_symm_mem_comm=None,
    )
    fields.update(comms)
    vars(group).update(fields)
    group.is_symmetric_memory_enabled = lambda: symm_mem
    group.debug_check_symmetric_mempool = lambda *args: None
    group._can_use_flashinfer_allreduce = lambda tensor: flashinfer
    group._flashinfer_allreduce = lambda tensor: calls.append("flashinfer_allreduce") or tensor
    monkeypatch.setitem(parallel_state._groups, group.unique_name, lambda: group)
    monkeypatch.setattr(
        torch.distributed,
        "all_reduce",
        lambda tensor, group=None: calls.append("torch.distributed.all_reduce"),
    )
    return group


def sglang_call(group, calls: list) -> str:
    """The one communicator call SGLang's real ``GroupCoordinator.all_reduce`` makes for PROBE."""
    calls.clear()
    with torch.no_grad():  # SGLang's serving path: its custom ops call their Python bodies
        group.all_reduce(PROBE)
    [call] = calls
    return call


def cases():
    """Every combination: each out-of-place communicator absent, present but not eligible, or
    eligible; pynccl absent or present (enabled, as inside ``graph_capture()``); SGLang's symmetric
    memory off or on; FlashInfer's all-reduce usable or not. Except the two where the PCIe IPC
    all-reduce, eligible, is the only communicator and FlashInfer's is not usable: SGLang's
    out-of-place dispatch refuses them (it asserts that one of the others exists)."""
    states = (None, False, True)
    for eligible in itertools.product(states, repeat=len(CHECKS)):
        eligible = dict(zip(CHECKS, eligible))
        for pynccl, symm_mem, flashinfer in itertools.product((False, True), repeat=3):
            present = {field for field, flag in eligible.items() if flag is not None}
            if present == {"pcie_ipc_comm"} and eligible["pcie_ipc_comm"]:
                if not (pynccl or flashinfer):
                    continue
            yield eligible, pynccl, symm_mem, flashinfer


@pytest.mark.quick
def test_the_route_is_the_communicator_sglangs_all_reduce_calls(monkeypatch):
    calls, wrong, checked = [], [], 0
    for eligible, pynccl, symm_mem, flashinfer in cases():
        comms = {
            field: Communicator(field, calls, flag)
            for field, flag in eligible.items()
            if flag is not None
        }
        if pynccl:
            comms["pynccl_comm"] = Communicator("pynccl_comm", calls)
        group = sglang_coordinator(
            monkeypatch, calls, symm_mem=symm_mem, flashinfer=flashinfer, **comms
        )
        call = sglang_call(group, calls)
        expected = (ROUTE_OF_CALL[call], call in NCCL_CALLS)
        got = all_reduce_route(group, PROBE)
        if got != expected:
            wrong.append(
                f"{eligible}, pynccl {pynccl}, symm-mem {symm_mem}, "
                f"flashinfer {flashinfer}: predicted {got}, SGLang {expected}"
            )
        checked += 1
    assert checked == 3**5 * 8 - 2
    assert not wrong, "\n".join(wrong[:20])


def test_mscclpp_wins_over_the_custom_all_reduce_when_both_are_eligible(monkeypatch):
    calls = []
    comms = {field: Communicator(field, calls) for field in ("ca_comm", "pymscclpp_comm")}
    group = sglang_coordinator(monkeypatch, calls, **comms)
    assert sglang_call(group, calls) == "pymscclpp_comm.all_reduce"
    assert all_reduce_route(group, PROBE) == ("MSCCL++", False)


class CustomAllReduceV2Like:
    """The fields of SGLang's ``CustomAllReduceV2`` the replay reads; ``_pick_config`` records the
    graph flag it is asked with."""

    def __init__(self, fits: bool, graph_supported=True, override_algo=None, max_size=1 << 20):
        self.disabled, self.fits, self.asked = False, fits, []
        self._is_graph_mode_supported, self.override_algo = graph_supported, override_algo
        self.max_size = max_size

    def _pick_config(self, nbytes, can_use_graph):
        self.asked.append((nbytes, can_use_graph))
        return object() if self.fits else None


def test_custom_all_reduce_v2_is_asked_with_its_graph_heuristic(monkeypatch):
    calls = []

    def route(v2, pynccl=True):
        comms = dict(ca_comm=v2)
        if pynccl:
            comms["pynccl_comm"] = Communicator("pynccl_comm", calls)
        return all_reduce_route(sglang_coordinator(monkeypatch, calls, **comms), PROBE)

    v2 = CustomAllReduceV2Like(fits=True)
    assert route(v2) == ("custom all-reduce (CustomAllReduceV2Like)", False)
    assert v2.asked == [(16 * 152 * 4, True)]

    eager_only = CustomAllReduceV2Like(fits=False, graph_supported=False)
    assert route(eager_only) == ("pynccl (in place)", True)
    assert eager_only.asked == [(16 * 152 * 4, False)]

    forced = CustomAllReduceV2Like(fits=False, override_algo="one_shot_push", max_size=64)
    assert route(forced, pynccl=False) == ("torch.distributed (NCCL)", True), "over max_size"


def test_cpu_tensors_and_single_ranks_never_need_nccl(monkeypatch):
    group = sglang_coordinator(monkeypatch, [])
    assert all_reduce_route(group, torch.zeros(2, 8)) == (
        "CPU shared memory or torch.distributed",
        False,
    )
    group.world_size = 1
    assert all_reduce_route(group, PROBE) == ("none (one rank)", False)


def test_sglang_custom_all_reduce_v2_still_has_the_fields_the_route_reads():
    from sglang.srt.distributed.device_communicators.custom_all_reduce_v2 import (
        CustomAllReduceV2,
    )

    init = inspect.getsource(CustomAllReduceV2.__init__)
    for field in ("self._is_graph_mode_supported", "self.override_algo", "self.max_size"):
        assert field in init
    assert list(inspect.signature(CustomAllReduceV2._pick_config).parameters) == [
        "self",
        "nbytes",
        "can_use_graph",
    ]
