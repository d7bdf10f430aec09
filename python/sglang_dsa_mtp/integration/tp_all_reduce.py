"""Which implementation SGLang 0.5.23's TP all-reduce would use for a tensor inside a graph capture.

``GroupCoordinator.all_reduce`` picks per call (``srt/distributed/parallel_state.py``): CPU tensors
go to shared memory or ``torch.distributed``; with ``--enable-symm-mem`` and neither MSCCL++ nor the
custom all-reduce eligible, pynccl; FlashInfer's all-reduce when the group has its workspace and the
tensor fits; then the out-of-place method its ``_resolve_outplace_all_reduce_method`` picks among
the custom all-reduce, PCIe IPC, quick all-reduce (ROCm), MSCCL++ and torch symmetric memory (bf16
only); else in place, which inside ``graph_capture()`` is pynccl (enabled there), else
``torch.distributed`` (NCCL).

:func:`all_reduce_route` follows that dispatch without side effects and says whether the capture
would run on NCCL. The choice among the out-of-place communicators is SGLang's own: its
``_resolve_outplace_all_reduce_method`` is called on a view of the group. In that view the custom
all-reduce answers as it would inside its ``capture()`` context: the V2's answer depends on it (its
graph heuristic, asked directly here), and entering ``capture()`` itself would register graph
buffers on exit. Every input is group-wide configuration, so the answer is the same on every rank;
:func:`agree_across_group` makes that so regardless.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from sglang.srt.distributed.parallel_state import GroupCoordinator

# The out-of-place methods of GroupCoordinator._resolve_outplace_all_reduce_method, as routes
# (the custom all-reduce's is named with its class), and whether each runs on NCCL.
_OUT_OF_PLACE = {
    "ca": ("custom all-reduce ({ca})", False),
    "pcie_ipc": ("PCIe IPC all-reduce", False),
    "qr": ("quick all-reduce", False),
    "pymscclpp": ("MSCCL++", False),
    "torch_symm_mem": ("torch symmetric memory", False),
    "pynccl": ("pynccl out of place", True),
}


def _custom_all_reduce_in_capture(ca, probe: torch.Tensor) -> bool:
    if ca is None or ca.disabled:
        return False
    if not hasattr(ca, "_pick_config"):  # the legacy CustomAllreduce: the same answer in capture
        return bool(ca.should_custom_ar(probe))
    nbytes = probe.numel() * probe.element_size()
    if nbytes % 16 != 0 or not probe.is_contiguous():
        return False
    if ca.override_algo is not None:
        return nbytes <= ca.max_size
    return ca._pick_config(nbytes, bool(ca._is_graph_mode_supported)) is not None


def _in_capture(group, custom: bool):
    """The communicators ``_resolve_outplace_all_reduce_method`` reads, as they answer inside
    ``graph_capture()``: the custom all-reduce gives its in-capture answer ``custom``."""
    ca = group.ca_comm
    if ca is not None:
        ca = SimpleNamespace(disabled=ca.disabled, should_custom_ar=lambda probe: custom)
    return SimpleNamespace(
        ca_comm=ca,
        pcie_ipc_comm=group.pcie_ipc_comm,
        qr_comm=group.qr_comm,
        pymscclpp_comm=group.pymscclpp_comm,
        torch_symm_mem_comm=group.torch_symm_mem_comm,
        pynccl_comm=group.pynccl_comm,
    )


def all_reduce_route(group, probe: torch.Tensor) -> tuple[str, bool]:
    """``(route, on_nccl)``: what ``group.all_reduce(probe)`` would run inside a CUDA-graph capture."""
    if group.world_size == 1:
        return "none (one rank)", False
    if probe.is_cpu:
        return "CPU shared memory or torch.distributed", False
    if not probe.is_cuda:
        return f"{probe.device.type} communicator (not evaluated)", True
    mscclpp = group.pymscclpp_comm is not None and bool(
        group.pymscclpp_comm.should_mscclpp_allreduce(probe)
    )
    custom = _custom_all_reduce_in_capture(group.ca_comm, probe)
    if (
        group.pynccl_comm is not None
        and group.is_symmetric_memory_enabled()
        and not mscclpp
        and not custom
    ):
        return "pynccl with symmetric memory (--enable-symm-mem)", True
    if group._can_use_flashinfer_allreduce(probe):
        return "FlashInfer all-reduce", False
    method = GroupCoordinator._resolve_outplace_all_reduce_method(
        _in_capture(group, custom), probe, should_use_pymscclpp_allreduce=mscclpp
    )
    if method is not None:
        route, nccl = _OUT_OF_PLACE[method]
        return route.format(ca=type(group.ca_comm).__name__), nccl
    if group.pynccl_comm is not None:
        return "pynccl (in place)", True
    return "torch.distributed (NCCL)", True


def agree_across_group(group, reason: Optional[str]) -> Optional[str]:
    """``reason`` on every rank if any rank has one (None only when all ranks have none).

    A collective on the group's CPU (gloo) group: every rank must call it. Should the collective
    itself fail, this rank keeps the gather, saying why."""
    cpu_group = getattr(group, "cpu_group", None)
    if group.world_size == 1 or cpu_group is None:
        return reason
    blocked = torch.tensor([0 if reason is None else 1], dtype=torch.int32)
    try:
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX, group=cpu_group)
    except Exception as exc:
        return reason or f"the TP ranks could not agree ({type(exc).__name__}: {exc})"
    if reason is None and int(blocked.item()):
        return "another TP rank keeps the gather (its reason is in its log)"
    return reason
