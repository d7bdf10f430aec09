"""The serving loop: SGLang's real DSA backends serving EAGLE rounds under CUDA graphs, the plugin on
and off in one process (``sglang_dsa_mtp.testing.serving_loop``, its docstring says what a round is).

After every replay, every metadata tensor the captured graphs read (``dsa_serving.READ``) equals the
off arm's, bit for bit (the compact page table on each row's live columns); nothing the plugin-on
arm launches compiles after its captures, fallback replays included; every injected failure (our
kernel at its warm-up and at a replay, the MTP decision at capture and its one launch at a replay,
the indexer's live copy mid-call) leaves exactly one line in the plugin's log and the comparisons
holding; and the arms are what they claim (the plugin's kernels, dropped tables, the QLEN_ONLY mask,
the one launch; SGLang's everywhere in the other).

On a GPU: SGLang's capture list for ``--cuda-graph-max-bs-decode 48``, a 1M-token context, real
CUDA graphs, 720 rounds (2,160 replays per arm: 120 rounds of each of the six servers). On the CPU, its twin: max bs 3, a 128-token
context, the graphs simulated, 24 rounds, Triton's interpreter (which compiles nothing).
"""

import pytest
import torch

from sglang_dsa_mtp.testing.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from sglang_dsa_mtp.testing.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp.testing import dsa_backends as kit
from sglang_dsa_mtp.testing import dsa_serving, serving_loop

GPU_ROUNDS = 720  # at least 2,000 replays per arm
CPU_ROUNDS = 24  # 4 per server: the injections' rounds


@pytest.fixture
def served(hooked):
    """The plugin applied by SGLang's plugin loader, the stand-ins for what the machine lacks."""
    kit.cuda_stand_ins(hooked)
    return hooked


def check(report: serving_loop.LoopReport, *, rounds: int) -> None:
    assert report.failures() == [], "\n".join(report.failures())
    assert sum(server.rounds for server in report.servers) == rounds
    assert report.replays == 3 * rounds
    assert {(s.name.split(",")[0], "unseeded" not in s.name) for s in report.servers} == {
        (f"EAGLE {name}", seeded) for name in serving_loop.LAUNCH_NAMES for seeded in (True, False)
    }
    kinds = [injection.where for injection in report.injections]
    assert sorted(set(kinds)) == ["capture", "indexer", "replay", "warm-up"]
    assert len(kinds) == 4 * len(report.servers) + 1
    assert report.indexer_calls and report.indexer_live_calls


@pytest.mark.gpu
def test_the_serving_loop_on_the_gpu_is_bit_identical_compiles_nothing_and_absorbs_failures(
    served,
):
    sizes = dsa_serving.GPU_SIZES
    config = serving_loop.LoopConfig(sizes=sizes, rounds=GPU_ROUNDS, indexer_every=20)
    report = serving_loop.run(config, served, progress=print)
    check(report, rounds=GPU_ROUNDS)
    for server in report.servers:
        assert server.captured == [*range(1, 9), *range(10, 33, 2), 40, 44, 48], server.name
    requests = sum(server.requests for server in report.servers)
    long = sum(server.long_requests for server in report.servers)
    assert 0.25 < long / requests < 0.45, "about a third of the requests past 64k tokens"


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the GPU form runs instead")
def test_the_serving_loop_on_the_cpu_is_bit_identical_and_absorbs_failures(served):
    config = serving_loop.LoopConfig(
        sizes=dsa_serving.cpu_sizes(), rounds=CPU_ROUNDS, indexer_every=8
    )
    report = serving_loop.run(config, served)
    check(report, rounds=CPU_ROUNDS)
    for server in report.servers:
        assert server.captured == [1, 2, 3], server.name
