"""What ``python -m sglang_dsa_mtp`` says about where the changes engage: the indexer's chunking
thresholds per GPU and EAGLE launch, the SM100 split path, and how the bounded kernels' replays
launch."""

import pytest

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp import status


@pytest.mark.parametrize(
    "num_sms,expected",
    [(78, [20, 16, 14]), (132, [34, 27, 23]), (148, [38, 30, 25])],
    ids=["h20", "h200", "b200"],
)
def test_requests_from_which_eagle_rows_are_chunked(num_sms, expected):
    """The thresholds of docs/indexer-cliff.md: rows = requests x draft tokens > SMs."""
    tokens = list(status.EAGLE_DRAFT_TOKENS.values())
    counts = [status.first_chunked_requests(num_sms, n) for n in tokens]
    assert counts == expected
    for requests, n in zip(counts, tokens):
        assert requests * n > num_sms >= (requests - 1) * n


@pytest.mark.quick
def test_an_h200_engages_in_target_verify_and_draft_extend():
    text = status.indexer_engagement(132)
    assert "this GPU's 132 SMs: target verify and draft extend from 34 / 27 / 23" in text


@pytest.mark.parametrize(
    "torch_logits,modes",
    [
        ("0", "draft extend (target verify on SM100 takes DeepGEMM's native path"),
        ("1", "target verify and draft extend (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 on SM100)"),
    ],
    ids=["deepgemm-logits", "torch-logits"],
)
def test_sm100_target_verify_engages_only_with_sglangs_torch_logits(
    monkeypatch, torch_logits, modes
):
    monkeypatch.setenv("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", torch_logits)
    assert f"this GPU's 148 SMs: {modes}" in status.indexer_engagement(148, sm100=True)


def test_without_a_gpu_the_h200_is_the_example():
    assert "the GPU's SMs (132 on an H200)" in status.indexer_engagement(None)


@pytest.mark.parametrize("release", ["3.6.0", "3.8.0+git1234abcd", "3.9.0", "3.3.1"])
def test_the_status_says_how_the_replays_launch_whatever_the_triton_release(
    release, triton_release, set_platform
):
    """The same launch path for any release: the C launch is chosen per op at capture, by a probe,
    never by the release number."""
    triton_release(release)
    set_platform(cuda=True, hip=False)
    rows, _ = status.installation_rows("cuda (a GPU)")
    assert dict(rows)["launches"] == (
        "bound once per captured batch size at capture; a bound launch goes through Triton's "
        "launch of the compiled kernel, or through Triton's C launch beneath it where a probe at "
        "capture found it writing every output bit for bit as Triton's JIT (per op and batch "
        f"size); any other call through the wrapper and Triton's JIT (Triton {release})"
    )


def test_without_cuda_the_status_says_no_launch_is_bound(triton_release, set_platform):
    triton_release("3.9.0")
    set_platform(cuda=False, hip=False)
    rows, _ = status.installation_rows("cpu, through Triton's interpreter")
    assert dict(rows)["launches"].startswith(
        "not used here, not a CUDA platform (no CUDA device); on CUDA: bound once per captured "
        "batch size at capture"
    )
