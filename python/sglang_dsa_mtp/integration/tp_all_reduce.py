"""Which implementation SGLang 0.5.23's TP all-reduce would use for a tensor inside a graph capture.

``GroupCoordinator.all_reduce`` picks per call, in this order (``srt/distributed/parallel_state.py``):
CPU tensors go to shared memory or ``torch.distributed``; with ``--enable-symm-mem`` and neither
MSCCL++ nor the custom all-reduce eligible, pynccl; FlashInfer's all-reduce when the group has its
workspace and the tensor fits; then the first eligible of the custom all-reduce, PCIe IPC, quick
all-reduce (ROCm), MSCCL++ and torch symmetric memory (bf16 only); else in place, which inside
``graph_capture()`` is pynccl (enabled there), else torch symmetric memory, else
``torch.distributed`` (NCCL). The custom all-reduce V2's answer depends on being inside its
``capture()`` context (its graph heuristic), so the V2 check here asks that heuristic directly;
entering ``capture()`` itself would register graph buffers on exit.

:func:`all_reduce_route` replays that chain without side effects and says whether the capture would
run on NCCL. Every input is group-wide configuration, so the answer is the same on every rank;
:func:`agree_across_group` makes that so regardless.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


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


def _eligible(comm, check: str, probe: torch.Tensor) -> bool:
    return comm is not None and not comm.disabled and bool(getattr(comm, check)(probe))


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
    if custom:
        return f"custom all-reduce ({type(group.ca_comm).__name__})", False
    if not mscclpp and _eligible(group.pcie_ipc_comm, "should_pcie_ipc_ar", probe):
        return "PCIe IPC all-reduce", False
    if _eligible(group.qr_comm, "should_quick_allreduce", probe):
        return "quick all-reduce", False
    if mscclpp:
        return "MSCCL++", False
    symm = _eligible(group.torch_symm_mem_comm, "should_torch_symm_mem_allreduce", probe)
    if symm:
        return "torch symmetric memory", False
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
