"""Which implementation SGLang's TP all-reduce would use for the exchange buffer inside a capture.

The route is replayed from the group's communicators (stand-ins with SGLang's method names: what
each one says about the probe is set per test); the probe stands in for a CUDA tensor. The last
test pins the private names of SGLang 0.5.23's custom all-reduce V2 that the replay reads.
"""

import inspect
from types import SimpleNamespace

import pytest

from sglang_dsa_mtp.test.sglang_import import require_sglang

require_sglang()

import torch

from sglang_dsa_mtp.integration.tp_all_reduce import all_reduce_route

PROBE = SimpleNamespace(is_cpu=False, is_cuda=True, numel=lambda: 16 * 152, element_size=lambda: 4)
PROBE.is_contiguous = lambda: True
PROBE.device = SimpleNamespace(type="cuda")


def comm(check: str, answer: bool, **fields):
    return SimpleNamespace(disabled=False, **{check: lambda probe: answer}, **fields)


def group(symm_mem=False, flashinfer=False, **comms):
    fields = dict(
        world_size=2,
        ca_comm=None,
        pynccl_comm=None,
        pymscclpp_comm=None,
        pcie_ipc_comm=None,
        qr_comm=None,
        torch_symm_mem_comm=None,
    )
    fields.update(comms)
    return SimpleNamespace(
        is_symmetric_memory_enabled=lambda: symm_mem,
        _can_use_flashinfer_allreduce=lambda probe: flashinfer,
        **fields,
    )


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


PYNCCL = SimpleNamespace(disabled=True)  # pynccl is disabled outside graph_capture()


@pytest.mark.parametrize(
    "the_group, route, nccl",
    [
        (group(), "torch.distributed (NCCL)", True),
        (group(pynccl_comm=PYNCCL), "pynccl (in place)", True),
        (group(pynccl_comm=PYNCCL, symm_mem=True), "pynccl with symmetric memory", True),
        (
            group(pynccl_comm=PYNCCL, ca_comm=comm("should_custom_ar", True)),
            "custom all-reduce",
            False,
        ),
        (
            group(pynccl_comm=PYNCCL, symm_mem=True, ca_comm=comm("should_custom_ar", True)),
            "custom all-reduce",
            False,
        ),
        (
            group(pynccl_comm=PYNCCL, ca_comm=comm("should_custom_ar", False)),
            "pynccl (in place)",
            True,
        ),
        (group(pynccl_comm=PYNCCL, flashinfer=True), "FlashInfer all-reduce", False),
        (
            group(pcie_ipc_comm=comm("should_pcie_ipc_ar", True)),
            "PCIe IPC all-reduce",
            False,
        ),
        (group(qr_comm=comm("should_quick_allreduce", True)), "quick all-reduce", False),
        (
            group(pymscclpp_comm=SimpleNamespace(should_mscclpp_allreduce=lambda p: True)),
            "MSCCL++",
            False,
        ),
        (
            group(
                torch_symm_mem_comm=comm("should_torch_symm_mem_allreduce", True),
                pynccl_comm=PYNCCL,
            ),
            "torch symmetric memory",
            False,
        ),
        (
            group(torch_symm_mem_comm=comm("should_torch_symm_mem_allreduce", False)),
            "torch.distributed (NCCL)",
            True,
        ),
    ],
    ids=[
        "no-communicators",
        "pynccl",
        "symm-mem-pynccl",
        "custom",
        "custom-before-symm-mem",
        "custom-ineligible",
        "flashinfer",
        "pcie-ipc",
        "quick",
        "mscclpp",
        "torch-symm-mem",
        "torch-symm-mem-ineligible",
    ],
)
def test_the_route_follows_sglangs_order(the_group, route, nccl):
    got_route, got_nccl = all_reduce_route(the_group, PROBE)
    assert route in got_route and got_nccl is nccl


def test_custom_all_reduce_v2_is_asked_with_its_graph_heuristic():
    v2 = CustomAllReduceV2Like(fits=True)
    assert all_reduce_route(group(pynccl_comm=PYNCCL, ca_comm=v2), PROBE)[1] is False
    assert v2.asked == [(16 * 152 * 4, True)]

    eager_only = CustomAllReduceV2Like(fits=False, graph_supported=False)
    assert all_reduce_route(group(pynccl_comm=PYNCCL, ca_comm=eager_only), PROBE)[1] is True
    assert eager_only.asked == [(16 * 152 * 4, False)]

    forced = CustomAllReduceV2Like(fits=False, override_algo="one_shot_push", max_size=64)
    assert all_reduce_route(group(ca_comm=forced), PROBE)[1] is True, "over max_size"


def test_cpu_tensors_and_single_ranks_never_need_nccl():
    assert all_reduce_route(group(), torch.zeros(2, 8)) == (
        "CPU shared memory or torch.distributed",
        False,
    )
    assert all_reduce_route(SimpleNamespace(world_size=1), PROBE) == ("none (one rank)", False)


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
