"""The target-verify graphs' logits memory (``testing.verify_logits_memory``): on the GPU, the
target-verify exchange keeps no byte beyond SGLang's after capture and peaks no higher, while the
positive control (the shard allocated in each capture, as the exchange first kept it) keeps its
shards; on the CPU, every arm of the dry run's cases builds, engages and captures."""

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from support.sglang_import import require_sglang, sglang_runtime_missing

require_sglang()

from sglang_dsa_mtp.integration.state import ProcessorState, peek  # noqa: E402
from support import dsa_serving  # noqa: E402
from support import verify_logits_memory as memory  # noqa: E402


@pytest.fixture
def plugin_loaded(monkeypatch, fresh_switches, sglang_targets_restored):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dsa_serving.prepare(monkeypatch, device)
    return device


def kept_rows(processor, logits):
    """The kept shard rows ``logits`` are of ``processor``'s target-verify exchange, or None."""
    verify = peek(processor, ProcessorState).verify
    return None if verify is None else verify.kept_rows(logits)


def kept_shards_bytes(case: memory.Case) -> int:
    """The bf16 shards every captured graph of ``case`` would keep for itself."""
    return sum(bs * case.tokens * case.vocab * 2 for bs in case.captured)


@pytest.mark.gpu
@pytest.mark.parametrize("width", list(memory.GPU_WIDTHS))
@pytest.mark.parametrize("max_bs", memory.MAX_BS)
def test_the_verify_exchange_keeps_no_graph_memory_beyond_sglangs(
    max_bs, width, plugin_loaded, monkeypatch
):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    missing = sglang_runtime_missing()
    if missing:
        pytest.skip(f"{missing}: source test/gpu_sglang_env.sh first")
    case = memory.cases(max_bs, plugin_loaded)[width]
    figures = memory.measure_case(case, plugin_loaded, monkeypatch)
    print({arm: f for arm, f in figures.items()})
    # A capture allocates; less allocated after it than before means an earlier arm's free
    # landed in this measurement, and "retained <= 0" would then prove nothing.
    assert all(f.captured >= 0 for f in figures.values()), figures
    assert memory.retained_beyond_stock(figures, "on") <= 0, figures
    assert figures["on"].peak <= figures["off"].peak, figures
    control = memory.retained_beyond_stock(figures, "per-graph shard")
    assert control >= kept_shards_bytes(case), f"the control keeps its shards: {figures}"


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the GPU test above")
def test_every_arm_of_the_dry_run_builds_engages_and_captures(plugin_loaded, monkeypatch):
    seen = []
    real = memory.logits_forward

    def recorded(processor, lm_head, hidden, **kwargs):
        output = real(processor, lm_head, hidden, **kwargs)
        seen.append((hidden.shape[0], output.next_token_logits, processor))
        return output

    monkeypatch.setattr(memory, "logits_forward", recorded)
    case = memory.cases(3, plugin_loaded)["TP 8 width"]
    assert case.captured == (1, 2, 3) and case.tokens == 4
    for arm in memory.ARMS:
        seen.clear()
        with memory.one_rank_group(plugin_loaded):
            memory.measure(case, arm, plugin_loaded, monkeypatch)
        assert [rows for rows, _, _ in seen] == [12, 8, 4], arm
        kept = [kept_rows(processor, logits) for _, logits, processor in seen]
        if arm == "on":
            assert all(k is not None for k in kept), "every graph's shard is in the shared buffer"
        else:
            assert all(k is None for k in kept), arm
