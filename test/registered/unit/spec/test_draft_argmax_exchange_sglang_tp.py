"""The draft argmax exchange through SGLang's own TP communicators, one all-reduce route at a time.

On two or more CUDA GPUs (one process per GPU, TP size = the visible GPU count), for each route of
``sglang_dsa_mtp.testing.sglang_gpu_tp.ROUTES`` (SGLang's custom all-reduce V2 and legacy, torch
symmetric memory, pynccl, pynccl with symmetric memory, each set by SGLang's own server args or
environment): SGLang builds its real TP group and device communicators, the plugin's hooks are
applied by SGLang's ``HookRegistry``, and ``exchange_routes_worker`` checks in CUDA graphs captured
inside SGLang's ``graph_capture()`` that the all-reduce route predicted at opt-in is the route SGLang
takes, that the exchange engages exactly on the routes that are not NCCL, and that the draft
``LogitsProcessor`` forward and greedy pick with the exchange on and off give SGLang's pick of the
gathered logits, bit for bit (bf16 and fp32 heads, vocab 154880 and 129281, the tie / NaN / inf
rows of ``argmax_cases``). A route SGLang does not build on the machine (no NVLink for the custom
all-reduce, no ``sgl_kernel`` for the legacy one) is skipped with the reason, after the checks that
still apply passed.

The GPU test needs SGLang's Python dependencies: ``source test/gpu_sglang_env.sh`` first (docs/
testing.md); without them it skips with the reason. On the CPU, where SGLang is installed, the same
worker runs eagerly in a two-process gloo group (the ``gloo`` route, small sizes), so that CI runs
the harness's checks too.
"""

import importlib.util
from importlib import metadata

import pytest
import torch

from sglang_dsa_mtp.testing.process_group import read_reports, run_group
from sglang_dsa_mtp.testing.sglang_gpu_tp import (
    CPU_ROUTE,
    CPU_SIZES,
    GPU_ROUTES,
    GPU_SIZES,
    exchange_routes_worker,
)
from sglang_dsa_mtp.testing.sglang_import import require_sglang

# Where the exchange must engage: on a route that is not NCCL inside the capture.
ENGAGES = {
    "custom-ar-v2": True,
    "custom-ar-legacy": True,
    "torch-symm-mem": False,  # SGLang's torch symmetric memory all-reduce takes bf16 only
    "pynccl": False,
    "symm-mem-pynccl": False,
    CPU_ROUTE: True,
}
# Top-level modules that importing SGLang needs and that a bare GPU machine lacks.
SGLANG_IMPORTS = ("pydantic", "zmq", "orjson", "msgspec", "tvm_ffi", "IPython", "openai", "fastapi")


def sglang_runtime_missing():
    """Why SGLang cannot be imported in the worker processes here, or None."""
    try:
        metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "SGLang's distribution metadata is not on the path"
    missing = [name for name in SGLANG_IMPORTS if importlib.util.find_spec(name) is None]
    if missing:
        return f"SGLang's dependencies {missing} are not importable"
    return None


def check_reports(reports, world, route, sizes):
    assert [r["rank"] for r in reports] == list(range(world)), reports
    skipped = sorted({r["skipped"] for r in reports if r.get("skipped")})
    if skipped:
        pytest.skip("; ".join(skipped))
    for report in reports:
        where = f"rank {report['rank']}, route {route}"
        assert report["failures"] == [], where
        assert report["feature"][0], f"{where}: {report['feature'][1]}"
        assert len(report["all_reduce"]) == 2 * len(sizes.vocabs), where
        for check in report["all_reduce"]:
            assert check["predicted"] == check["taken"], f"{where}: {check}"
            assert check["sums_exact"], f"{where}: {check}"
        assert len(report["forwards"]) == len(sizes.vocabs) * len(sizes.dtypes), where
        for forward in report["forwards"]:
            assert forward["checked"] == (len(sizes.decode_rows) + 1) * sizes.replays, where
            if report["not_offered"] is None:
                assert forward["engaged"] is ENGAGES[route], f"{where}: {forward}"
            if forward["engaged"]:
                assert forward["taken"] == [forward["route"]] * (len(sizes.decode_rows) + 1)
    not_offered = sorted({r["not_offered"] for r in reports if r["not_offered"]})
    if not_offered:
        pytest.skip(f"route {route} not offered here ({'; '.join(not_offered)}); checks passed")


@pytest.mark.gpu
@pytest.mark.parametrize("route", GPU_ROUTES)
def test_exchange_takes_the_predicted_route_and_picks_sglangs_tokens_in_cuda_graphs(
    route, tmp_path
):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"needs at least 2 CUDA GPUs for a real TP group, found {world}")
    missing = sglang_runtime_missing()
    if missing:
        pytest.skip(f"{missing}: source test/gpu_sglang_env.sh first")
    run_group(exchange_routes_worker, world, str(tmp_path), route, timeout_s=900)
    check_reports(read_reports(str(tmp_path), world), world, route, GPU_SIZES)


@pytest.mark.gpu
def test_one_gpu_builds_sglangs_group_and_replays_the_gathered_pick_in_cuda_graphs(tmp_path):
    """The harness on one GPU: SGLang's group of one rank on NCCL with its defaults, the plugin
    registered, the captures inside ``graph_capture()``; the processor keeps the gather (nothing to
    exchange with), and every replay picks SGLang's tokens."""
    missing = sglang_runtime_missing()
    if missing:
        pytest.skip(f"{missing}: source test/gpu_sglang_env.sh first")
    run_group(exchange_routes_worker, 1, str(tmp_path), "custom-ar-v2", timeout_s=900)
    (report,) = read_reports(str(tmp_path), 1)
    assert report["failures"] == [] and report["feature"][0], report
    assert {(c["predicted"], c["taken"]) for c in report["all_reduce"]} == {
        ("none (one rank)", "none (one rank)")
    }
    assert len(report["forwards"]) == len(GPU_SIZES.vocabs) * len(GPU_SIZES.dtypes), report
    for forward in report["forwards"]:
        assert forward["engaged"] is False, forward
        assert forward["checked"] == (len(GPU_SIZES.decode_rows) + 1) * GPU_SIZES.replays


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_exchange_route_checks_hold_eagerly_in_a_cpu_tp_group(tmp_path):
    require_sglang()
    run_group(exchange_routes_worker, 2, str(tmp_path), CPU_ROUTE, timeout_s=600)
    reports = read_reports(str(tmp_path), 2)
    check_reports(reports, 2, CPU_ROUTE, CPU_SIZES)
    for report in reports:
        assert {c["predicted"] for c in report["all_reduce"]} == {
            "CPU shared memory or torch.distributed"
        }
