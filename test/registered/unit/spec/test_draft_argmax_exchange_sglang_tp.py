"""The draft argmax exchange through SGLang's own TP communicators, one all-reduce route at a time.

On two or more CUDA GPUs (one process per GPU, TP size = the visible GPU count), for each route of
``support.tp.ROUTES`` (SGLang's custom all-reduce V2 and legacy, torch
symmetric memory, pynccl, pynccl with symmetric memory, each set by SGLang's own server args or
environment): SGLang builds its real TP group and device communicators, the plugin's hooks are
applied by SGLang's ``HookRegistry``, and :func:`exchange_routes_worker` (here) checks in CUDA graphs captured
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

from dataclasses import dataclass

import pytest
import torch

from support import tp_routes
from support.argmax_cases import (
    differences,
    padded_shard_width,
    pick_state,
    reference_pick,
)
from support.sglang_import import require_sglang
from support.tp import CPU_ROUTE, GPU_ROUTES, read_reports, run_group, shared_hidden


@dataclass(frozen=True)
class Sizes:
    """What :func:`exchange_routes_worker` runs: vocab sizes, hidden size, decode row counts, the
    draft extend's selected rows (of twice as many), replays per graph, logits dtypes."""

    vocabs: tuple[int, ...]
    hidden: int
    decode_rows: tuple[int, ...]
    extend_rows: int
    replays: int
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

    @property
    def max_rows(self) -> int:
        return max(*self.decode_rows, self.extend_rows)

    def forwards(self) -> int:
        """Graphs per engaged route and rank with the exchange on (as many with it off)."""
        return len(self.vocabs) * len(self.dtypes) * (len(self.decode_rows) + 1)


GPU_SIZES = Sizes(
    vocabs=(154880, 129281), hidden=512, decode_rows=(1, 5, 16), extend_rows=8, replays=3
)
CPU_SIZES = Sizes(vocabs=(1001,), hidden=64, decode_rows=(3,), extend_rows=2, replays=2)


def check_route(world, route, sizes, tmp_path, timeout_s) -> list[dict]:
    """:func:`exchange_routes_worker` on ``world`` ranks for ``route``, then each rank's report
    checked at ``sizes``; returns the reports."""
    run_group(exchange_routes_worker, world, str(tmp_path), route, timeout_s=timeout_s)
    reports = read_reports(str(tmp_path), world)

    def check_rank(report, where):
        assert len(report["all_reduce"]) == 2 * len(sizes.vocabs), where
        for check in report["all_reduce"]:
            assert check["predicted"] == check["taken"], f"{where}: {check}"
            assert check["sums_exact"], f"{where}: {check}"
        assert len(report["forwards"]) == len(sizes.vocabs) * len(sizes.dtypes), where
        for forward in report["forwards"]:
            assert forward["checked"] == (len(sizes.decode_rows) + 1) * sizes.replays, where
            if report["not_offered"] is None:
                assert forward["engaged"] is tp_routes.ENGAGES[route], f"{where}: {forward}"
            if forward["engaged"]:
                assert forward["taken"] == [forward["route"]] * (len(sizes.decode_rows) + 1)

    return tp_routes.check_route_reports(reports, world, route, check_rank)


@pytest.mark.gpu
@pytest.mark.parametrize("route", GPU_ROUTES)
def test_exchange_takes_the_predicted_route_and_picks_sglangs_tokens_in_cuda_graphs(
    route, tp_gpus, tmp_path
):
    check_route(tp_gpus, route, GPU_SIZES, tmp_path, timeout_s=900)


@pytest.mark.gpu
def test_one_gpu_builds_sglangs_group_and_replays_the_gathered_pick_in_cuda_graphs(
    sglang_runtime, tmp_path
):
    """The harness on one GPU: SGLang's group of one rank on NCCL with its defaults, the plugin
    registered, the captures inside ``graph_capture()``; the processor keeps the gather (nothing to
    exchange with), and every replay picks SGLang's tokens."""
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
    for report in check_route(2, CPU_ROUTE, CPU_SIZES, tmp_path, timeout_s=600):
        assert {c["predicted"] for c in report["all_reduce"]} == {
            "CPU shared memory or torch.distributed"
        }


# --- each rank's body: run_group spawns exchange_routes_worker, pickled by this module's name ---


def check_all_reduce_route(group, recorder, shape, device, replays: int) -> dict:
    """SGLang's all-reduce of an fp32 ``shape`` buffer: the route predicted at opt-in
    (``all_reduce_route``) against the route taken inside the capture, and each replay's sum
    (rank r contributes ``(r + 1) * (replay + 1)``) against the exact sum."""
    from sglang_dsa_mtp.integration.vocab_shard_exchange import all_reduce_route

    buffer = torch.zeros(shape, dtype=torch.float32, device=device)
    predicted, on_nccl = all_reduce_route(group, buffer)
    replay, taken = tp_routes.capture_on_route(
        lambda: group.all_reduce(buffer), group, device, recorder
    )
    result = dict(
        shape=list(shape), predicted=predicted, on_nccl=on_nccl, taken=taken, sums_exact=True
    )
    world, rank = group.world_size, group.rank_in_group
    for k in range(replays):
        buffer.fill_(float((rank + 1) * (k + 1)))
        reduced = replay()
        expected = torch.full(shape, float(world * (world + 1) // 2 * (k + 1)), device=device)
        result["sums_exact"] &= bool(torch.equal(reduced, expected))
    return result


def _forward_cases(sizes: Sizes, device) -> list:
    """``(mode, rows, select_index)``: decode at each row count; the graph draft extend with
    ``extend_rows`` selected (reversed, repeated) rows of twice as many."""
    cases = [("decode", rows, None) for rows in sizes.decode_rows]
    rows = 2 * sizes.extend_rows
    select = torch.arange(rows - 1, -1, -2, dtype=torch.int64)
    select[-1] = select[0]
    cases.append(("draft_extend_v2", rows, select.to(device)))
    return cases


def _check_forwards(group, recorder, device, sizes, vocab, dtype, expect_engaged, seed):
    """One vocab and dtype: the opt-in, then every forward case captured with the exchange on
    (when engaged) and off, each replay's picks against SGLang's pick from the logits that replay
    produced (all-gathered with SGLang's ``GroupCoordinator.all_gather``)."""
    from sglang_dsa_mtp.integration.state import ProcessorState, peek
    from support.deployment import (
        bits_differ,
        build_lm_head,
        logits_forward,
        logits_processor,
        sglang_pick,
    )

    rank, world = group.rank_in_group, group.world_size
    where = f"vocab {vocab}, {dtype}"
    lm_head, gather_processor, _ = build_lm_head(
        vocab, sizes.hidden, dtype=dtype, seed=seed, device=device
    )
    exchange_processor = logits_processor(vocab)
    engaged = exchange_processor.enable_draft_argmax_exchange(lm_head, max_rows=sizes.max_rows)
    state = peek(exchange_processor, ProcessorState).draft
    result = dict(
        vocab=vocab,
        dtype=str(dtype),
        engaged=engaged,
        route=None if state is None else state.route,
        taken=[],
        checked=0,
        failures=[],
    )
    failures = result["failures"]
    if engaged != expect_engaged:
        failures.append(f"{where}: engaged {engaged}, expected {expect_engaged}")
    width = lm_head.num_embeddings_per_partition
    overlay = tp_routes.ShardOverlay(sizes.max_rows, world, rank, width, vocab, dtype, device)
    arms = {"gather": gather_processor}
    if engaged:
        arms["exchange"] = exchange_processor
    stashes = {name: overlay.apply_to(processor) for name, processor in arms.items()}

    for mode, rows, select in _forward_cases(sizes, device):
        picked = rows if select is None else select.shape[0]
        case = f"{where}, {mode}, {picked} rows"
        hidden = torch.zeros(rows, sizes.hidden, dtype=dtype, device=device)
        states = {name: pick_state(picked, device) for name in arms}
        replays = {}
        for name, processor in arms.items():

            def body(processor=processor, state=states[name]):
                output = logits_forward(processor, lm_head, hidden, mode=mode, select_index=select)
                pick = sglang_pick(output, mode, *state)
                return pick, output.next_token_argmax_partials is not None

            replays[name], taken = tp_routes.capture_on_route(body, group, device, recorder)
            if name == "exchange":
                tp_routes.record_route_taken(result, taken, state.route, case)
        for k in range(sizes.replays):
            names = overlay.fill(first_pattern=k * picked + rows)
            hidden.copy_(
                shared_hidden(
                    rows, sizes.hidden, seed=seed * 1000 + 31 * k + rows, dtype=dtype, device=device
                )
            )
            picks, partials = {}, {}
            for name, replay in replays.items():
                fresh = pick_state(picked, device)
                for static, value in zip(states[name], fresh):
                    static.copy_(value)
                picks[name], partials[name] = replay()
            if device.type == "cuda":
                torch.cuda.synchronize()
            gathered = group.all_gather(stashes["gather"]["logits"].contiguous(), dim=-1)
            positions, draft_tokens = pick_state(picked, device)
            if mode == "decode":
                topk_p, topk_index = reference_pick(
                    gathered, vocab, "sanitize", positions, draft_tokens, 1
                )
                want = dict(
                    topk_p=topk_p,
                    topk_index=topk_index,
                    positions=positions,
                    draft_tokens=draft_tokens,
                )
            else:
                want = dict(topk_index=reference_pick(gathered, vocab, "propagate")[1])
            for name in arms:
                differing = differences(picks[name], want)
                if differing:
                    got = picks[name]["topk_index"].view(-1).tolist()
                    failures.append(
                        f"{case}, replay {k}, {name}: {', '.join(differing)} differ from SGLang's "
                        f"pick of the gathered logits (ours {got}, "
                        f"SGLang's {want['topk_index'].view(-1).tolist()}; rows {names[:picked]})"
                    )
            if partials["gather"]:
                failures.append(f"{case}: the gather processor returned partials")
            if engaged:
                if not partials["exchange"]:
                    failures.append(f"{case}: the engaged processor returned no partials")
                problem = bits_differ(stashes["exchange"]["logits"], stashes["gather"]["logits"])
                if problem:
                    failures.append(
                        f"{case}, replay {k}: the two graphs' LM-head logits differ ({problem})"
                    )
            result["checked"] += 1
    return result


def exchange_routes_worker(
    rank: int, world: int, init_method: str, result_dir: str, route_name: str
) -> None:
    """Body of the route test of the draft argmax exchange, one process per rank; writes
    ``rank<r>.json``.

    In SGLang's TP group for ``route_name``, with the plugin registered and its hooks applied by
    SGLang's ``HookRegistry``, and an ``AllReduceRecorder`` on the group
    (``tp_routes.run_route_checks``):

    * the device communicators SGLang built, and whether the route is offered here;
    * for each vocab, the fp32 exchange buffer's all-reduce at 1 and the most rows: the route
      predicted at opt-in (``all_reduce_route``) equals the route taken inside the CUDA-graph capture
      (:func:`check_all_reduce_route`), and every replay's sum is exact;
    * for each vocab and dtype, ``enable_draft_argmax_exchange`` engages exactly when that route is
      not NCCL, and names the predicted route; then SGLang's draft ``LogitsProcessor`` forward and
      the greedy pick (decode: ``draft_topk1_postprocess``, hooked; graph draft extend: the
      ``propagate`` finalize or ``torch.argmax``) are captured with the exchange on (when engaged)
      and off, and replayed with new hidden states and new :data:`argmax_cases.PATTERNS` rows
      (ties, NaN, inf, signed zeros over the LM-head logits): tokens, ``topk_p``, positions and
      draft tokens of both equal SGLang's pick from the all-gathered logits of that replay, bit for
      bit, and the exchange ran on the predicted route inside the capture.

    On the CPU (``route_name == "gloo"``) the same runs eagerly, at :data:`CPU_SIZES`. With one
    rank (one GPU) the processor gathers nothing and keeps SGLang's path; the group, the captures
    and the picks are still checked.
    """
    tp_routes.run_route_checks(
        rank, world, init_method, result_dir, route_name, "draft_argmax_exchange", _check_routes
    )


def _check_routes(group, device, recorder, report) -> None:
    """:func:`exchange_routes_worker`'s checks in the route's group, at the route's sizes."""
    from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape

    sizes = CPU_SIZES if report["route"] == CPU_ROUTE else GPU_SIZES
    world, failures = group.world_size, report["failures"]
    report["all_reduce"] = []
    for i, vocab in enumerate(sizes.vocabs):
        width = padded_shard_width(vocab, world)
        checks = [
            check_all_reduce_route(
                group, recorder, exchange_shape(rows, width, world), device, sizes.replays
            )
            for rows in sorted({1, sizes.max_rows})
        ]
        report["all_reduce"] += checks
        for check in checks:
            if check["predicted"] != check["taken"]:
                failures.append(
                    f"vocab {vocab}, {check['shape']}: all-reduce predicted "
                    f"{check['predicted']}, taken {check['taken']}"
                )
            if not check["sums_exact"]:
                failures.append(f"vocab {vocab}, {check['shape']}: inexact sum")
        # One rank gathers nothing: the exchange needs a TP group.
        expect_engaged = world > 1 and not any(c["on_nccl"] for c in checks)
        for j, dtype in enumerate(sizes.dtypes):
            result = _check_forwards(
                group, recorder, device, sizes, vocab, dtype, expect_engaged, 10 * i + j
            )
            failures += result.pop("failures")
            report["forwards"].append(result)
