"""Which replay-metadata kernels a real SGLang DSA backend ends up with, once our hook is applied.

Backends are built without a model (``object.__new__``, as SGLang's own ``dsa_metadata_kit`` does) and
run SGLang's real ``_init_kpool_metadata_fusion``, wrapped by the plugin's real hook row. Where ours
are selected, each attribute holds ours with SGLang's kernel behind it as the fallback
(``test_dsa_metadata_fallback.py`` tests the fallback on backends SGLang builds and replays).
"""

import logging

import pytest

from support.sglang_import import require_sglang

require_sglang()

import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager
from sglang.kernels.ops.attention.dsa import metadata as sglang_metadata
from sglang.srt.environ import envs
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.integration import dsa_metadata_selection as selection
from sglang_dsa_mtp.integration.fallback import fallback_of
from sglang_dsa_mtp.integration.state import BackendState, peek
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA

OURS = (
    bounded.fused_dsa_decode_metadata_bounded,
    bounded.fused_dsa_target_verify_metadata_bounded,
    bounded.fused_dsa_draft_extend_metadata_bounded,
)
SGLANG_UNBOUNDED = (
    sglang_metadata.fused_dsa_decode_metadata,
    sglang_metadata.fused_dsa_target_verify_metadata,
    sglang_metadata.fused_dsa_draft_extend_metadata,
)


def build_backend(kpool=1, page_size=64, topk=2048, fusion=True):
    backend = object.__new__(DeepseekSparseAttnBackend)
    backend.dsa_index_kpool = kpool
    backend.physical_page_size = page_size
    backend.dsa_index_topk = topk
    with envs.SGLANG_EXPERIMENTAL_DSA_KPOOL_METADATA_FUSION.override(fusion):
        backend._init_kpool_metadata_fusion()
    return backend


def decision(backend):
    """Why the backend keeps SGLang's kernels (None: ours), as the selection hook recorded it."""
    return peek(backend, BackendState).bounded_reason


def kernels(backend, behind="ours"):
    """The kernels the backend's replay runs: ours where they are selected, else SGLang's; with
    ``behind="sglang"``, the fallbacks behind ours."""
    attrs = (
        backend._fused_decode_metadata,
        backend._fused_verify_metadata,
        backend._fused_draft_extend_metadata,
    )
    return tuple(getattr(fallback_of(fn), behind, fn) for fn in attrs)


def test_plugin_hooks_sglang_kernel_selection():
    targets = {row.target for row in hooks.rows_of(BOUNDED_REPLAY_METADATA)}
    assert (
        "sglang.srt.layers.attention.dsa.dsa_metadata_manager."
        "DSAMetadataManagementMixin._init_kpool_metadata_fusion"
    ) in targets


@pytest.mark.quick
def test_cuda_kpool1_without_fusion_selects_bounded_kernels(hooked):
    backend = build_backend()
    assert kernels(backend) == OURS
    assert decision(backend) is None


def test_a_gate_that_raises_keeps_sglangs_kernels_with_one_error(hooked, caplog):
    def raising(backend):
        raise RuntimeError("injected failure")

    hooked.setattr(selection, "why_not_bounded", raising)
    with caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        built = [build_backend(), build_backend()]
    assert [kernels(backend) for backend in built] == [SGLANG_UNBOUNDED] * 2
    assert decision(built[0]) == "the gate raised RuntimeError: injected failure"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "sglang_dsa_mtp: a DSA backend keeps SGLang's replay-metadata kernels: the gate raised: "
        "RuntimeError: injected failure"
    ]


def test_sglang_kernels_stay_behind_ours_as_the_fallback(hooked):
    assert kernels(build_backend(), behind="sglang") == SGLANG_UNBOUNDED


def test_a_hook_sglang_left_unapplied_keeps_sglangs_kernels(hooked, unapplied):
    """The capture hook warms ours up; had SGLang's ``HookRegistry`` left it unapplied (it logs and
    skips a target that fails to apply), ours would first compile while serving."""
    why = unapplied("DeepseekSparseAttnBackend._build_forward_metadata_cuda_graph")
    backend = build_backend()
    assert kernels(backend) == SGLANG_UNBOUNDED
    assert decision(backend) == why


@pytest.mark.parametrize("page_size", [1, 64])
def test_bounded_kernels_selected_for_every_page_size_at_kpool1(hooked, page_size):
    assert kernels(build_backend(page_size=page_size)) == OURS


def test_hip_keeps_sglang_kernels(hooked, set_platform):
    set_platform(cuda=False, hip=True)
    backend = build_backend()
    assert kernels(backend) == SGLANG_UNBOUNDED
    assert "HIP" in decision(backend)


def test_a_backend_the_hook_never_saw_keeps_sglang_kernels():
    assert decision(object.__new__(DeepseekSparseAttnBackend)) is not None


def test_non_cuda_platform_keeps_sglang_kernels(hooked, set_platform):
    set_platform(cuda=False, hip=False)
    assert kernels(build_backend()) == SGLANG_UNBOUNDED


def test_kpool_above_1_with_fusion_keeps_sglang_kpool_kernels(hooked):
    backend = build_backend(kpool=4, fusion=True)
    assert backend.experimental_kpool_metadata_fusion
    assert all(fn.keywords == {"index_kpool": 4} for fn in kernels(backend))
    assert "dsa_index_kpool is 4" in decision(backend)


def test_kpool_above_1_without_fusion_keeps_sglang_kernels(hooked):
    backend = build_backend(kpool=4, fusion=False)
    assert not backend.experimental_kpool_metadata_fusion
    assert kernels(backend) == SGLANG_UNBOUNDED


def test_fusion_flag_set_at_kpool1_keeps_sglang_kernels(hooked):
    """KPool fusion owns the kernels whenever it is on, whatever made it so."""
    hooked.setattr(manager, "kpool_metadata_fusion_supported", lambda *args: True)
    backend = build_backend(kpool=1, fusion=True)
    assert backend.experimental_kpool_metadata_fusion
    assert kernels(backend) != OURS
    assert "fusion is on" in decision(backend)


@pytest.mark.parametrize("value", ["0", "false", "off"], ids=["zero", "false", "unparsable"])
def test_kill_switch_keeps_sglang_kernels(hooked, value):
    hooked.setenv(BOUNDED_REPLAY_METADATA.env, value)
    assert kernels(build_backend()) == SGLANG_UNBOUNDED


def test_a_failing_gate_keeps_sglang_kernels(hooked):
    hooked.setattr(selection, "why_not_bounded", lambda backend: 1 / 0, raising=True)
    backend = build_backend()
    assert kernels(backend) == SGLANG_UNBOUNDED
    assert "ZeroDivisionError" in decision(backend)
