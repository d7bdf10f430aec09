"""A DSA attention layer of SGLang's under graphs, the plugin on and off (``support.dsa_layer``, its
docstring says what runs and what stands in): the indexer's top-k and the attention output of every
replay equal bit for bit, beside the metadata the graphs read; the plugin-on arm launched our
replay-metadata kernels in every op, the plugin-off arm none.

On a GPU: GLM-5's attention (64 heads, 512 + 64 latent dims, 32 index heads of 128, index top-k
2048, page 64) at a 64k-token context, max bs 16, SGLang's real top-k, FlashMLA metadata and
sparse decode, its JIT metadata copies, in real CUDA graphs, EAGLE 4/1/5 (target verify, three
draft decode steps) and a server without speculative decoding. On the CPU, its twin at the
serving slice's CPU sizes (a 128-token context, index top-k 48), the graphs simulated, SGLang's
torch top-k, FlashMLA's sparse decode a torch function of what it reads.
"""

import dataclasses

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from support.sglang_import import require_sglang

require_sglang()

from support import dsa_layer, dsa_serving, real_ops
from support import dsa_backends as kit

GPU_SIZES = dataclasses.replace(
    dsa_serving.GPU_SIZES, context=64 * 1024, max_bs=16, pool=2 * 16 + 1
)
ROUNDS = {"gpu": 16, "cpu": 6}
# Each op's runner and the plugin's kernel it must launch on the plugin-on arm.
SERVERS = [pytest.param("4/1/5", id="EAGLE-4-1-5"), pytest.param(None, id="no-spec")]


@pytest.fixture
def layer_run(hooked):
    """``layer_run(device, launch, **options)``: ``dsa_layer.run`` with SGLang's own leaves on a GPU
    (FlashMLA must load; SGLang's JIT leaves where they build), the CPU's stand-ins off one."""

    def run(device: str, launch, **options):
        if device == "gpu":
            real_ops.import_flash_mla()
            kit.cuda_stand_ins(hooked, real=real_ops.usable_leaves())
            sizes = GPU_SIZES
        else:
            kit.cuda_stand_ins(hooked)
            dsa_layer.cpu_stand_ins(hooked)
            sizes = dsa_serving.cpu_sizes(3)
        return dsa_layer.run(
            hooked, sizes, launch, options.pop("rounds", ROUNDS[device]), **options
        )

    return run


@pytest.mark.parametrize("launch", SERVERS)
@pytest.mark.parametrize("glue", [pytest.param(False, id="eager"), pytest.param(True, id="glued")])
def test_the_layer_reads_what_sglang_prepares_bit_for_bit_and_ours_prepared_it(
    layer_run, device, launch, glue
):
    report = layer_run(device, launch, glue=glue)
    print(f"{report.name}: bs {report.captured}, replays {dict(report.replays)}")
    print(f"top-k entries naming a token: {report.selected}")
    print(f"top-k reads equal sorted, in another order as handed: {report.reordered}")
    print(f"our launches: plugin on {dict(report.ours)}, plugin off {dict(report.ours_off)}")
    assert report.mismatches == [], "\n".join(report.mismatches[:20])
    ops = ("target verify", "draft decode") if launch else (dsa_serving.DECODE,)
    rounds = ROUNDS[device]
    assert dict(report.replays) == {op: rounds for op in ops}
    assert report.comparisons > 0 and report.finite and report.selected > 0
    for op in ops:
        assert report.ours[op] >= rounds, f"{op}: ours launched {report.ours[op]} times"
    assert sum(report.ours_off.values()) == 0, "the plugin-off arm launched ours"


@pytest.mark.quick
def test_a_planted_difference_in_the_metadata_reaches_the_layers_output(layer_run):
    """The comparison sees the layer: the plugin-on arm's FlashMLA lengths one short in every
    replay (after its prep, before its graph) change the attention output."""

    def shorten(runner, bs):
        for backend in runner.backends:
            backend.decode_cuda_graph_metadata[bs].dsa_cache_seqlens_int32.sub_(1)

    device = "gpu" if torch.cuda.is_available() else "cpu"
    report = layer_run(device, None, rounds=2, corrupt=shorten)
    assert report.mismatches, "the planted difference went unseen"
    assert all("output" in line or "dsa_cache_seqlens" in line for line in report.mismatches)
    assert any(line.endswith("output") for line in report.mismatches), report.mismatches


@pytest.mark.quick
def test_the_outputs_of_the_steps_sglang_leaves_stale_plans_to_are_set_aside_alone():
    """A draft step whose indexer plans the stock arm's prep leaves as they were
    (``dsa_serving.stale_steps``: steps 0 to 2 under SGLang's JIT multi-step copy) has its top-k
    and output left out of the comparison; every other step's are compared."""
    from types import SimpleNamespace

    names = [f"step {i} {what}" for i in range(4) for what in ("top-k", "output")]
    on = SimpleNamespace(forward_reads={2: {name: torch.zeros(3) for name in names}})
    off = SimpleNamespace(forward_reads={2: {name: torch.ones(3) for name in names}})
    compared = dsa_layer.differences(on, off, 2, stale=range(3))
    assert [name for name, differs in compared if differs] == ["step 3 output", "step 3 top-k"]
    assert all(differs for _, differs in dsa_layer.differences(on, off, 2))
    assert len(dsa_layer.differences(on, off, 2)) == len(names)


@pytest.mark.parametrize("change", ["order", "set"])
def test_the_comparison_sees_the_tokens_each_row_selects_not_the_order_they_come_in(
    layer_run, hooked, change
):
    """Off a GPU, a top-k that hands each row's tokens in a new order at every call (as SGLang's
    JIT top-k may: its output slots are reserved by atomics) leaves the arms equal, the layer
    sorting each row before the attention; one whose selected set changes from call to call
    (each call drops another of a row's first two tokens) fails the comparison on the top-k."""
    calls = []

    def top_k(scores, seq_lens, page_tables, out, page_size, metadata):
        original(scores, seq_lens, page_tables, out, page_size, metadata)
        calls.append(None)
        if change == "order":
            order = torch.randperm(
                out.shape[1], generator=torch.Generator().manual_seed(len(calls))
            )
            out.copy_(out[:, order])
        else:
            out[:, len(calls) % 2] = -1

    original = dsa_layer.paged_topk_stand_in
    hooked.setattr(dsa_layer, "paged_topk_stand_in", top_k)
    report = layer_run("cpu", None, rounds=3)
    assert calls, "the top-k stand-in never ran"
    if change == "order":
        assert report.mismatches == []
        assert report.reordered > 0, "the reordered reads went uncounted"
    else:
        assert any(line.endswith("top-k") for line in report.mismatches), report.mismatches
