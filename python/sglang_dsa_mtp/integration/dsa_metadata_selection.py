"""Hook site: the DSA backend's choice of replay-metadata kernels.

SGLang 0.5.23's ``DSAMetadataManagementMixin._init_kpool_metadata_fusion`` (run in every
``DeepseekSparseAttnBackend.__init__``: target, draft extend and each MTP draft step) stores the three
kernels it picked in ``_fused_decode_metadata`` / ``_fused_verify_metadata`` /
``_fused_draft_extend_metadata``; the backend's CUDA-graph replay and the MTP precompute call only
those attributes. After it ran, this AFTER hook puts the bounded kernels there when they apply, each
behind SGLang's kernel as its per-batch-size fallback (``fallback.with_fallback``), and records the
decision on the backend (``DECISION``: None when ours apply, else the reason). The decision is
logged once per backend when it captures its first CUDA graph (``dsa_metadata_capture``), where its
role is known.
"""

from __future__ import annotations

from sglang.srt.utils import is_cuda, is_hip

from sglang_dsa_mtp.integration.fallback import with_fallback
from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded import (
    fused_dsa_decode_metadata_bounded,
    fused_dsa_draft_extend_metadata_bounded,
    fused_dsa_target_verify_metadata_bounded,
)
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA

DECISION = "_sglang_dsa_mtp_bounded"  # None: the bounded kernels are selected; else why not
# (backend attribute SGLang calls, our kernel, the operation's name in the log)
KERNELS = (
    ("_fused_decode_metadata", fused_dsa_decode_metadata_bounded, "decode"),
    ("_fused_verify_metadata", fused_dsa_target_verify_metadata_bounded, "target verify"),
    ("_fused_draft_extend_metadata", fused_dsa_draft_extend_metadata_bounded, "draft extend"),
)


def why_not_bounded(backend) -> str | None:
    """Why ``backend`` must keep SGLang's replay-metadata kernels, or None when ours apply."""
    enabled, why = BOUNDED_REPLAY_METADATA.state()
    if not enabled:
        return why
    if is_hip():
        return "HIP: the bounded kernels are CUDA-only"
    if not is_cuda():
        return "not a CUDA platform"
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
        reason = f"the gate raised {type(exc).__name__}: {exc}"
    if reason is None:
        for attr, ours, op in KERNELS:
            sglang = getattr(backend, attr)
            setattr(backend, attr, with_fallback(ours, sglang, what=f"DSA {op} replay metadata"))
    setattr(backend, DECISION, reason)
    return result


def selected_kernel(backend, attr: str):
    """``backend.<attr>`` when it runs our kernel (``with_fallback``: ``.ours``, ``.fall_back``),
    else None."""
    if getattr(backend, DECISION, "") is not None:
        return None
    kernel = getattr(backend, attr, None)
    return kernel if hasattr(kernel, "fall_back") else None
