"""Hook site: the DSA backend's choice of replay-metadata kernels.

SGLang 0.5.23's ``DSAMetadataManagementMixin._init_kpool_metadata_fusion`` (run in every
``DeepseekSparseAttnBackend.__init__``: target, draft extend and each MTP draft step) stores the three
kernels it picked in ``_fused_decode_metadata`` / ``_fused_verify_metadata`` /
``_fused_draft_extend_metadata``; the backend's CUDA-graph replay and the MTP precompute call only
those attributes. After it ran, the AFTER hook puts the bounded kernels there when they apply, each
behind SGLang's kernel as its per-batch-size fallback (:class:`~.fallback.Fallback`, installed as its
bound ``__call__``), and records the decision in the backend's state (logged once when the backend
captures its first CUDA graph, where its role is known: ``dsa_metadata_capture``).
"""

from __future__ import annotations

from sglang_dsa_mtp.hooks import why_off
from sglang_dsa_mtp.integration.fallback import Fallback, fallback_of
from sglang_dsa_mtp.integration.state import BackendState, peek, state_of
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded import (
    fused_dsa_decode_metadata_bounded,
    fused_dsa_draft_extend_metadata_bounded,
    fused_dsa_target_verify_metadata_bounded,
)
from sglang_dsa_mtp.log import gate_failure
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA

# (backend attribute SGLang calls, our kernel, the operation's name in the log)
KERNELS = (
    ("_fused_decode_metadata", fused_dsa_decode_metadata_bounded, "decode"),
    ("_fused_verify_metadata", fused_dsa_target_verify_metadata_bounded, "target verify"),
    ("_fused_draft_extend_metadata", fused_dsa_draft_extend_metadata_bounded, "draft extend"),
)


def why_not_bounded(backend) -> str | None:
    """Why ``backend`` must keep SGLang's replay-metadata kernels, or None when ours apply. Ours need
    every hook of the change applied (``hooks.why_off``): without the capture hook, for one, they
    would first compile while serving."""
    reason = why_off(BOUNDED_REPLAY_METADATA)
    if reason is not None:
        return reason
    kpool = getattr(backend, "dsa_index_kpool", None)
    if kpool != 1:
        return f"dsa_index_kpool is {kpool}, the bounded kernels need 1"
    if getattr(backend, "experimental_kpool_metadata_fusion", False):
        return "KPool metadata fusion is on and owns the metadata kernels"
    return None


def select_bounded_metadata_kernels(result, backend, *args, **kwargs):
    """AFTER ``_init_kpool_metadata_fusion``: point the backend at the bounded kernels when they apply."""
    try:
        reason = why_not_bounded(backend)
    except Exception as exc:  # never take the server down: SGLang's kernels stay
        reason = gate_failure(exc, "a DSA backend keeps SGLang's replay-metadata kernels")
    if reason is None:
        for attr, ours, op in KERNELS:
            sglang = getattr(backend, attr)
            fallback = Fallback(ours, sglang, what=f"DSA {op} replay metadata")
            setattr(backend, attr, fallback.installed)
    state_of(backend, BackendState).bounded_reason = reason
    return result


def selected_kernel(backend, attr: str) -> Fallback | None:
    """The :class:`Fallback` ``backend.<attr>`` calls when it runs our kernel (behind SGLang's),
    else None."""
    if peek(backend, BackendState).bounded_reason is not None:
        return None
    return fallback_of(getattr(backend, attr, None))
