"""The self-checks of ``python -m sglang_dsa_mtp``: running them (every check in order, a raising check
a failed one), each check passing on SGLang's own code, untimed on the CPU (through Triton's
interpreter: SGLang's replay-metadata wrappers with their CUDA asserts stripped) and timed on a GPU,
and each check failing where one of our outputs is wrong."""

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()  # the checks import SGLang's kernels as the plugin does, through its package

from sglang_dsa_mtp import selfcheck
from sglang_dsa_mtp.devices import select_device
from sglang_dsa_mtp.selfcheck import CHECKS, CheckResult, SelfCheck, run_checks
from support.reference import metadata_module

DEVICE = select_device()
CHECK_NAMES = [check.name for check in CHECKS]
SLOW_ON_THE_CPU = {"draft argmax partials + finalize"}  # about 20 s through the interpreter
ON_THE_CPU = pytest.mark.skipif(
    DEVICE.type == "cuda",
    reason="the CPU branch runs through Triton's interpreter, which is off on a GPU machine",
)


@pytest.fixture
def sglang_on_the_cpu(monkeypatch):
    """SGLang's replay-metadata module with its CUDA asserts stripped, so that it runs on CPU
    tensors (nothing else about it changes)."""
    monkeypatch.setattr(
        selfcheck, "sglang_metadata_kernels", lambda: metadata_module(strip_asserts=True)
    )


def registered(name: str) -> SelfCheck:
    [check] = [c for c in CHECKS if c.name == name]
    return check


@pytest.mark.quick
def test_run_checks_runs_every_check_in_order_on_the_given_device():
    seen = []

    def check(name, ok):
        def fn(device):
            seen.append((name, device))
            return CheckResult(ok, name)

        return SelfCheck(name, fn)

    checks = (check("a", True), check("b", False))
    cpu = torch.device("cpu")
    assert run_checks(checks, cpu) == [
        (checks[0], CheckResult(True, "a")),
        (checks[1], CheckResult(False, "b")),
    ]
    assert seen == [("a", cpu), ("b", cpu)]


def test_a_check_that_raises_is_a_failed_check():
    def broken(device):
        raise RuntimeError("out of resources")

    [(_, result)] = run_checks((SelfCheck("broken", broken),), torch.device("cpu"))
    assert result == CheckResult(False, "raised RuntimeError: out of resources")


def test_the_replay_metadata_checks_need_cuda_and_the_others_do_not():
    """SGLang's replay-metadata wrappers assert CUDA tensors; its draft pick and the concat don't."""
    assert {check.name for check in CHECKS if check.needs_cuda} == {
        "bounded DSA replay metadata",
        "one-launch MTP draft decode metadata",
    }


@ON_THE_CPU
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in SLOW_ON_THE_CPU else pytest.mark.quick) for n in CHECK_NAMES],
)
def test_each_check_passes_untimed_on_the_cpu(name, sglang_on_the_cpu):
    result = registered(name).check(torch.device("cpu"))
    assert result.ok, result.detail
    assert (result.ours_us, result.sglang_us) == (None, None)


def _one_element_off(kernel, name: str):
    """``kernel`` that leaves one element of its output ``name`` wrong."""

    def wrong(*args, **kwargs):
        out = kernel(*args, **kwargs)
        target = kwargs.get(name)
        if target is None:  # the one launch: the last destination's buffer
            target = getattr(kwargs["destinations"][-1], name)
        target.view(-1)[-1] += 1
        return out

    return wrong


@ON_THE_CPU
@pytest.mark.parametrize(
    "name, module, kernel, output",
    [
        (
            "bounded DSA replay metadata",
            selfcheck.bounded,
            "fused_dsa_draft_extend_metadata_bounded",
            "real_page_table",
        ),
        (
            "one-launch MTP draft decode metadata",
            selfcheck.draft_decode,
            "fused_dsa_draft_decode_metadata_multi",
            "dsa_cu_seqlens_k",
        ),
    ],
)
def test_a_metadata_check_fails_on_one_wrong_element(
    name, module, kernel, output, monkeypatch, sglang_on_the_cpu
):
    """The comparison reads whole buffers: one element past the batch (a spare row) is seen."""
    monkeypatch.setattr(module, kernel, _one_element_off(getattr(module, kernel), output))
    result = registered(name).check(torch.device("cpu"))
    assert not result.ok and "differ" in result.detail


@ON_THE_CPU
@pytest.mark.quick
def test_the_live_logits_check_fails_on_one_wrong_live_column(monkeypatch):
    copy = selfcheck.live.chunked_paged_mqa_logits_live

    def wrong(*args, **kwargs):
        out = copy(*args, **kwargs)
        out[-1, 0] += 1  # the last row's first column: live unless its length is 0
        return out

    monkeypatch.setattr(selfcheck.live, "chunked_paged_mqa_logits_live", wrong)
    result = registered("live-width indexer logits (chunked)").check(torch.device("cpu"))
    assert not result.ok, result.detail


@ON_THE_CPU
def test_the_argmax_check_fails_on_one_wrong_token(monkeypatch):
    finalize = selfcheck.argmax.draft_argmax_finalize

    def wrong(*args, **kwargs):
        topk_p, topk_index = finalize(*args, **kwargs)
        topk_index[-1] += 1
        return topk_p, topk_index

    monkeypatch.setattr(selfcheck.argmax, "draft_argmax_finalize", wrong)
    result = registered("draft argmax partials + finalize").check(torch.device("cpu"))
    assert not result.ok and "TP 2" in result.detail


@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_each_check_passes_timed_against_sglang_on_a_gpu(name):
    """SGLang's default sizes (1M-token table, vocab 154880), both arms timed."""
    result = registered(name).check(torch.device("cuda"))
    assert result.ok, result.detail
    assert result.ours_us > 0 and result.sglang_us > 0, result
