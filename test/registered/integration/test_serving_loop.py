"""The serving loop: SGLang's real DSA backends serving EAGLE rounds under CUDA graphs, the plugin on
and off in one process (``support.serving_loop``, its docstring says what a round is).

After every replay, every metadata tensor the captured graphs read (``dsa_serving.READ``, checked
against every tensor of the metadata) equals the off arm's, bit for bit (the compact page table on
the pages SGLang's kernels write); the plugin-on arm ran ours (counted where our kernels launch) in
at least 90% of each op's replays, the misses only at fault victims, never where a Fallback sends
the bs to SGLang's kernel, and every ``Fallback.failed`` holds only the injected victims; each
runner replayed at least half of its captured batch sizes, at least a fifth of its replays padded;
nothing the plugin-on arm launches compiles after its captures, fallback replays included (on a GPU
the counter's positive controls count compiles); every injected failure (our kernel at its warm-up
and at a replay, the MTP decision at capture and its one launch at a replay, the indexer's live copy
mid-call), at four distinct batch sizes per server, leaves exactly one line in the plugin's log and
the comparisons holding; and the arms are what they claim (the plugin's kernels, dropped tables,
the QLEN_ONLY mask, the one launch; SGLang's everywhere in the other). Each server recaptures once
mid-run, as SGLang recaptures while serving (new graph runners over the same backends, their graph
state made again): the arms are what they claim after it too, and the rounds after it agree bit for
bit, glued and eager. Each kernel whose launches are bound at capture launched ours at a batch size
no injection routes (glued: in the glue's capture), and on a GPU the bound launch took every such
launch.

On a GPU: SGLang's capture list for ``--cuda-graph-max-bs-decode 48``, a 1M-token context, real
CUDA graphs, 720 rounds (2,160 replays per arm: 120 rounds of each of the six servers), the
engagement and batch-size tables printed. On the CPU, its twin: max bs 10 (SGLang's list: 1 .. 8,
10), a 128-token context, the graphs simulated, 120 rounds (20 per server), a program budget of
2 (programs span requests), Triton's interpreter (which compiles nothing).

The negative control, on both: the loop with every replay sent to SGLang's kernels behind our
Fallbacks (and off the MTP one launch) must count no launch of ours and fail on engagement alone.
``serving_loop_bugs.py`` beside it checks that deliberate bugs fail these tests.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from support.sglang_stubs import install_native_stubs

install_native_stubs()  # sgl_kernel, where absent: SGLang imports it at module level, never calls it

from support.sglang_import import require_sglang

require_sglang()

import sglang.kernels.ops.attention.dsv4.topk as topk_v2

from support import dsa_backends as kit
from support import dsa_serving, real_ops, serving_loop
from support.constants import POISON

GPU_ROUNDS = 720  # at least 2,000 replays per arm
CPU_ROUNDS = 6 * serving_loop.MIN_ROUNDS_INJECTED  # ours in 90% of each server's replays
# The CPU twin's --cuda-graph-max-bs-decode: SGLang's capture list to 10 (1 .. 8, 10), five batch
# sizes besides the four fault victims for the random rounds, bs 10 past 8 requests (16 lanes a
# program).
CPU_MAX_BS = 10
# The negative control: one EAGLE launch, seeded and unseeded, 4 rounds each, no injections, no
# indexer calls; at max bs 3 on the CPU, 8 on the GPU.
NEGATIVE = dict(
    servers=(("4/1/5", True), ("4/1/5", False)), rounds=8, inject=False, indexer_every=0
)


@pytest.fixture
def served(hooked):
    """The plugin applied by SGLang's plugin loader; on a GPU, SGLang's own leaves of the DSA prep
    where they run there (``real_ops.real_leaves``: its JIT paged-MQA schedule, top-k v2 plan and
    metadata copies, FlashMLA's metadata), the stand-ins for the rest and on the CPU."""
    kit.cuda_stand_ins(hooked, real=real_ops.usable_leaves() if torch.cuda.is_available() else ())
    return hooked


def check(report: serving_loop.LoopReport, *, rounds: int, glue: bool) -> None:
    assert report.failures() == [], "\n".join(report.failures())
    for server in report.servers:  # the glue's share is checked by failures() where it counted
        assert set(server.glued) == (set(dsa_serving.OPS) if glue else set()), server.name
    assert sum(server.rounds for server in report.servers) == rounds
    assert report.replays == 3 * rounds
    assert {(s.name.split(",")[0], "unseeded" not in s.name) for s in report.servers} == {
        (f"EAGLE {name}", seeded) for name in serving_loop.LAUNCH_NAMES for seeded in (True, False)
    }
    kinds = [injection.where for injection in report.injections]
    assert sorted(set(kinds)) == ["capture", "indexer", "replay", "warm-up"]
    assert len(kinds) == 4 * len(report.servers) + 1
    for server in report.servers:
        victims = {i.what.rpartition(" ")[2] for i in report.injections if server.name in i.what}
        assert len(victims) == 4, f"{server.name}: the victims repeat: {victims}"
    assert report.indexer_calls >= 10 and report.indexer_live_calls
    for server in report.servers:
        recaptured = server.recaptured_after
        assert recaptured and recaptured < server.rounds, f"{server.name}: recaptured {recaptured}"
    check_batch_sizes(report)


def check_batch_sizes(report: serving_loop.LoopReport) -> None:
    """Each runner of each server replayed at least half of its captured batch sizes, and at least
    a fifth of its replays, not all, padded (a batch of fewer requests than the bs)."""
    for server in report.servers:
        for op in dsa_serving.OPS:
            ran, replays = server.batch_sizes[op], server.replays[op]
            assert 2 * len(ran) >= len(server.captured), f"{server.name}, {op}: bs {sorted(ran)}"
            padded = server.padded[op]
            assert (
                5 * padded >= replays and padded < replays
            ), f"{server.name}, {op}: {padded} of {replays} replays padded"


# The plugin-on arm's replay prep: through the metadata glue (SGLANG_DSA_METADATA_GLUE=1), and
# eager (the switch's default).
PREPS = [pytest.param(True, id="glued"), pytest.param(False, id="eager")]


@pytest.mark.gpu
@pytest.mark.parametrize("glue", PREPS)
def test_the_serving_loop_on_the_gpu_is_bit_identical_compiles_nothing_and_absorbs_failures(
    served, glue
):
    sizes = dsa_serving.GPU_SIZES
    config = serving_loop.LoopConfig(sizes=sizes, rounds=GPU_ROUNDS, indexer_every=20, glue=glue)
    report = serving_loop.run(config, served, progress=print)
    print(serving_loop.engagement_table(report))
    print(serving_loop.batch_size_table(report))
    print(serving_loop.glue_table(report))
    on, off = report.compiles_on_capture, report.compiles_off
    print(f"Triton compiles: plugin-on captures {on}, plugin off while serving {off}")
    check(report, rounds=GPU_ROUNDS, glue=glue)
    assert report.compiles_off > 0 and report.compiles_on_capture > 0, "the counter counts"
    for server in report.servers:
        assert server.captured == [*range(1, 9), *range(10, 33, 2), 40, 44, 48], server.name
    requests = sum(server.requests for server in report.servers)
    long = sum(server.long_requests for server in report.servers)
    assert 0.25 < long / requests < 0.45, "about a third of the requests past 64k tokens"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the GPU form runs instead")
@pytest.mark.parametrize("glue", PREPS)
def test_the_serving_loop_on_the_cpu_is_bit_identical_and_absorbs_failures(served, glue):
    config = serving_loop.LoopConfig(
        sizes=dsa_serving.cpu_sizes(CPU_MAX_BS), rounds=CPU_ROUNDS, indexer_every=12, glue=glue
    )
    report = serving_loop.run(config, served, progress=print)
    print(serving_loop.engagement_table(report))
    print(serving_loop.batch_size_table(report))
    print(serving_loop.glue_table(report))
    check(report, rounds=CPU_ROUNDS, glue=glue)
    for server in report.servers:
        assert server.captured == [*range(1, 9), 10], server.name


def test_the_negative_control_every_replay_on_sglangs_kernels_counts_no_launch_of_ours(
    served, device
):
    """The loop with every Fallback of the plugin-on arm sending every captured bs to SGLang's
    kernel and every MTP draft-decode bs off the one launch (``LoopConfig.sglang_only``): the
    counter counts no launch of ours (nor credits a call with one: no spanning, bindable or bound
    launch), counts
    SGLang's kernel behind our Fallbacks in every replay, and the run fails on engagement (the
    bound launch's check seeing no launch of ours among it), and on nothing else (the arms still
    agree bit for bit). On the GPU, at max bs 8."""
    if device == "gpu":
        sizes = dataclasses.replace(dsa_serving.GPU_SIZES, max_bs=8, pool=2 * 8 + 1)
    else:
        sizes = dsa_serving.cpu_sizes(3)
    config = serving_loop.LoopConfig(sizes=sizes, sglang_only=True, **NEGATIVE)
    report = serving_loop.run(config, served, progress=print)
    print(serving_loop.engagement_table(report))
    assert report.calls == {}, f"launches of ours counted: {report.calls}"
    facts = {"credited": report.credited, "spanning": report.spanned}
    facts.update(bindable=report.bindable, bound=report.bound)
    assert not any(n for counts in facts.values() for n in counts.values()), facts
    rounds = sum(server.rounds for server in report.servers)
    assert rounds == NEGATIVE["rounds"] and report.replays == 3 * rounds
    for kernel in serving_loop.RUNNER_KERNEL.values():
        assert report.fell_back.get(kernel, 0) >= rounds, report.fell_back
    failures = report.failures()
    for server in report.servers:
        for op in serving_loop.ENGAGED:
            line = f"{server.name}: ours ran in 0 of {server.ours_of(op)[1]} {op} replays"
            assert line in failures, "\n".join(failures)
    engagement = (
        "ours ran in 0 of",
        "ours did not run",
        "launch had more live tiles than",
        "the bound launch's check saw no",
    )
    others = [line for line in failures if not any(part in line for part in engagement)]
    assert others == [], "\n".join(others)


# A server without speculative decoding (``serving_loop.run_plain``): its rounds on the GPU, at the
# loop's sizes (max bs 48, a 1M-token context), and on the CPU at the twin's.
PLAIN_ROUNDS = {"gpu": 360, "cpu": 30}


def plain_sizes(device: str) -> dsa_serving.Sizes:
    return dsa_serving.GPU_SIZES if device == "gpu" else dsa_serving.cpu_sizes(CPU_MAX_BS)


@pytest.mark.parametrize("glue", PREPS)
def test_a_non_speculative_server_is_bit_identical_runs_ours_in_every_replay_and_compiles_nothing(
    served, device, glue
):
    """Plain decode, the one runner of a DSA server without speculative decoding: every replay
    bit-identical to SGLang's, our decode kernel launched in each (with the glue: as the glue's
    graph, every replay, padded included), never in the off arm's, nothing compiled after the
    captures, a recapture a third of the way in; on a GPU the launch bound at capture took every
    launch of ours, and the compile counter counts."""
    rounds, op = PLAIN_ROUNDS[device], dsa_serving.DECODE
    report, calls = serving_loop.run_plain(plain_sizes(device), rounds, served, glue=glue)
    print(f"{report.name}, bs {report.captured}: {serving_loop._batch_sizes_run(report, op)}")
    print(f"glued {report.glued}")
    print(f"launches of ours {dict(calls.launches)}, bound {dict(calls.bound)}")
    assert [fact for fact, ok in report.engaged.items() if not ok] == []
    assert len(report.engaged) == (10 if device == "gpu" else 8)
    assert report.mismatches == [] and report.unexpected == []
    assert report.rounds == report.replays[op] == rounds and report.comparisons
    assert report.ours == {"decode": rounds} and calls.launches == {"decode": rounds}
    assert not calls.fell_back
    assert report.glued == ({op: rounds} if glue else {}) and not report.glue_eager.get(op)
    assert 0 < report.recaptured_after < rounds
    assert 2 * len(report.batch_sizes[op]) >= len(report.captured)
    assert 5 * report.padded[op] >= rounds > report.padded[op]
    assert calls.bindable["decode"] == rounds
    assert calls.bound["decode"] == (rounds if device == "gpu" else 0)


def test_a_non_speculative_servers_negative_control_counts_no_launch_of_ours(served, device):
    """The same server with every captured bs of the on arm's decode Fallback sent to SGLang's
    kernel before the capture, glued: every replay still bit-identical, SGLang's kernel behind our
    Fallback counted in every replay, no launch of ours."""
    rounds, op = 12, dsa_serving.DECODE
    sizes = plain_sizes(device)
    report, calls = serving_loop.run_plain(sizes, rounds, served, glue=True, sglang_only=True)
    assert report.mismatches == [] and report.unexpected == []
    assert report.ours == {"decode": 0} and not calls.launches and not calls.bindable
    assert calls.fell_back == {"decode": rounds} and report.glued == {op: rounds}


@pytest.mark.quick
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_bound_launch_check_names_each_kernel_it_saw_none_of_or_that_a_bound_launch_missed(
    device,
):
    """``LoopReport.failures`` on a report of one server: each kernel of ``BOUND`` with no launch
    of ours at a bs no injection routes is named on every device; one whose such launches a bound
    launch did not all take, on a GPU only (the CPU's interpreted kernels are never bound)."""
    report = serving_loop.LoopReport(device=device, context=128, max_bs=2)
    report.servers.append(serving_loop.ServerReport(name="server", captured=[1, 2]))

    def named() -> list[str]:
        return [line for line in report.failures() if "bound launch" in line]

    report.bindable = {op: 3 for op in serving_loop.BOUND}
    report.bound = dict(report.bindable)
    assert named() == []
    where = "at a batch size no injection routes"
    for op in serving_loop.BOUND:
        report.bound[op] = 2
        took = f"the bound launch took 2 of 3 {op} launches of ours {where}"
        assert named() == ([took] if device == "cuda" else []), op
        report.bindable[op] = report.bound[op] = 0
        assert named() == [f"the bound launch's check saw no {op} launch of ours {where}"], op
        report.bindable[op] = report.bound[op] = 3


@pytest.mark.quick
def test_the_comparison_names_a_planted_difference_in_each_buffer_and_refuses_uncompared_metadata(
    served,
):
    """One replay of each op at bs 2 (every request at 1 token), both arms equal; then one element
    of each buffer the comparison reads made to differ in the plugin-on arm's read, one at a time:
    the comparison names that buffer and no other. ``real_page_table``: page 1 (past the live page
    0, inside SGLang's first 128-column block) is named, page 2 (past the block: SGLang writes
    nothing there) is not; FlashMLA's schedule: word 0 of a row is named, its ``_pad`` word
    (FlashMLA never writes it) is not; the top-k plan is not compared where the installed plan op
    writes none (SGLang's JIT plan at the row counts its cluster top-k does not take). Each planted
    word is told by ``describe`` among the words compared: one word differs, where, and both
    values (none, for a word set aside). A READ
    tensor set to None, or a tensor READ does not list, stops the comparison with an error naming
    it."""
    name = "3/1/4"
    sizes = dsa_serving.cpu_sizes(max_bs=2)
    tokens = kit.LAUNCHES[name][2]
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(
        0, 1 << 30, (sizes.pool, sizes.context + 4 + tokens), generator=gen
    )
    req_to_token = req_to_token.to(torch.int32)
    with dsa_serving.launch(name, sizes) as (_, captured):
        arms = [
            dsa_serving.Arm(
                label,
                env,
                sizes=sizes,
                tokens=tokens,
                req_to_token=req_to_token,
                seeded=False,
                kernels=kernels,
            )
            for label, env, kernels in (
                ("on", dsa_serving.ON, None),
                ("off", dsa_serving.OFF, dsa_serving.sglang_metadata_kernels(sizes.device)),
            )
        ]
        for arm in arms:
            arm.capture(captured)
        on, off = arms
        kit_plan = topk_v2.plan_topk_v2
        bs, slots = 2, dsa_serving.request_tensor([1, 2], sizes.device)
        for op in dsa_serving.OPS:
            length = 1 + tokens if op == "draft extend" else 1
            lengths = dsa_serving.request_tensor([length] * bs, sizes.device)
            accepted = torch.ones(bs, dtype=torch.int32) if op == "draft extend" else None
            for arm in arms:
                arm.runners[op].poison(bs, POISON)
                arm.replay(op, bs, lengths, slots, accepted)

            def named():
                found = dsa_serving.differences(on.runners[op], off.runners[op], bs)
                return {label for label, differs in found if bool(differs)}

            assert named() == set(), op
            reads = on.runners[op].read(bs)
            assert {buffer.rpartition(" ")[2] for buffer in reads} == set(dsa_serving.READ), op
            for buffer, out in reads.items():
                written, unwritten = {buffer}, []
                if buffer.endswith("real_page_table"):
                    written, cells, unwritten = {buffer + " (written)"}, [(0, 1)], [(0, 2)]
                elif buffer.endswith("flashmla_metadata.flashmla_metadata"):
                    written, cells = {buffer + " (written)"}, [(0, 0)]
                    unwritten = [(0, dsa_serving.FLASHMLA_PAD_COLUMN)]
                else:
                    cells = [(0,) * out.dim()]
                for cell in cells + unwritten:
                    kept = out[cell].clone()
                    out[cell] += 1
                    expected = set() if cell in unwritten else written
                    assert named() == expected, (op, buffer, cell)
                    told = dsa_serving.describe(on.runners[op], off.runners[op], bs, buffer)
                    assert told == (
                        f"{buffer}: equal"
                        if cell in unwritten
                        else f"{buffer}: 1 of {out.numel()} words differ, first at {cell}: "
                        f"ours {int(kept) + 1}, SGLang's {int(kept)}"
                    ), told
                    out[cell] = kept
            served.setattr(topk_v2, "plan_topk_v2", lambda lens, threshold=-1, *, out=None: out)
            for buffer, out in reads.items():
                if buffer.endswith("topk_v2_plan"):
                    out.view(-1)[0] += 1
                    assert named() == set(), (op, buffer)
                    out.view(-1)[0] -= 1
            served.setattr(topk_v2, "plan_topk_v2", kit_plan)
        metadata = on.target.decode_cuda_graph_metadata[bs]
        for field, value in (("dsa_cache_seqlens_int32", None), ("stray", torch.zeros(1))):
            broken = SimpleNamespace(**{**vars(metadata), field: value})
            with pytest.raises(dsa_serving.UncomparedMetadata, match=field):
                dsa_serving.metadata_reads(broken)


@pytest.mark.quick
def test_a_plan_of_sglangs_top_k_is_compared_as_its_kernel_defines_it():
    """SGLang's ``plan_topk_v2`` writes row 0 (threshold, N) and N (row, length) items in the order
    its atomics append them, and nothing past them: two plans with the same items in another order
    and other words past them are equal; another threshold, count, item row or item length is a
    difference."""
    stock = torch.tensor([[65536, 3], [4, 70000], [2, 90000], [1, 66000], [7, 7], [-5, 3]])
    ours = torch.tensor([[65536, 3], [1, 66000], [4, 70000], [2, 90000], [0, 0], [2, 2]])
    stock, ours = stock.int(), ours.int()
    assert not dsa_serving.plan_differs(ours, stock)
    for cell, value in (((0, 0), 98304), ((0, 1), 2), ((2, 0), 3), ((3, 1), 90001)):
        changed = ours.clone()
        changed[cell] = value
        assert dsa_serving.plan_differs(changed, stock), cell


def test_sglangs_multi_step_copy_leaves_the_first_three_steps_indexer_plans(hooked):
    """Past three draft steps SGLang's draft decode takes its JIT multi-step metadata copy, which
    leaves the indexer plans of step backends 0 to 2 as they were: those reads are set aside, and
    only where that copy is SGLang's (the stand-in raises, and SGLang's fallback refreshes every
    step)."""
    arm = SimpleNamespace(speculative=True, multi=SimpleNamespace(speculative_num_steps=4))
    stale = dsa_serving.stale_step_plans(arm)
    assert stale == tuple(
        f"step {i} {name}" for i in range(3) for name in dsa_serving.INDEXER_PLANS
    )
    arm.multi.speculative_num_steps = 3
    assert dsa_serving.stale_step_plans(arm) == ()
    assert dsa_serving.stale_step_plans(SimpleNamespace(speculative=False)) == ()
    kit.cuda_stand_ins(hooked)
    arm.multi.speculative_num_steps = 4
    assert dsa_serving.stale_step_plans(arm) == ()
