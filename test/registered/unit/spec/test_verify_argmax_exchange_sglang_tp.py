"""The target-verify argmax exchange in SGLang's own TP group, in CUDA graphs, one all-reduce route
at a time.

In one process per rank (TP size = the visible GPU count), for each route of
``support.tp.ROUTES``: SGLang builds its real TP group and device communicators, the
plugin's hooks are applied by SGLang's ``HookRegistry``, and :func:`verify_routes_worker` (here)
builds the target's ``ParallelLMHead`` and two SGLang ``LogitsProcessor``\\ s of it, one opted in to
the exchange (``vocab_shard_exchange.opt_in``, as the EAGLE worker calls it) and one on SGLang's
path. Each target-verify forward (EAGLE 4/1/5: 5 rows a request; 1, 4 and 16 requests) is captured
as SGLang's graph runners capture (inside ``graph_capture()``) and replayed with new hidden states
and new rows of ties, NaN, infinities and signed zeros written over the LM-head logits, the batch
sliced to its requests as SGLang's runner slices it (one request of padding on odd replays), and
verified by SGLang's ``eagle_sample``, greedy and sampled batches in turn:

* the exchange engages exactly on the routes that are not NCCL inside the capture (and at TP 1),
  and its all-reduce runs on the route it predicted;
* greedy: the exchanged argmax equals the argmax of SGLang's gathered logits, and predict, accept
  lengths, accept index and the committed tokens equal SGLang's, bit for bit;
* sampled (rejection sampling on seeded coins; on the GPU with top-k) and logit-biased batches: the
  logits gathered after the replay equal the in-graph gather's whole rows, bit for bit, and the
  verify outcome equals SGLang's;
* on the GPU, nothing compiles after the opt-in: the captures, the replays and the full-logits tail
  at every batch size.

A route SGLang does not build on the machine is skipped with the reason after the checks that still
apply passed. The GPU tests need SGLang's Python dependencies (``source test/gpu_sglang_env.sh``);
on one GPU the same worker runs with one rank (the TP 1 exchange: no all-reduce, the cast after the
replay). On the CPU (CI) it runs eagerly in a two-process gloo group at vocab 1001.
"""

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support import tp_routes
from support.argmax_cases import padded_shard_width
from support.sglang_import import require_sglang
from support.tp import CPU_ROUTE, GPU_ROUTES, read_reports, run_group, shared_hidden

STEPS = 4  # EAGLE 4/1/5
TOKENS = STEPS + 1


@dataclass(frozen=True)
class Sizes:
    """What :func:`verify_routes_worker` runs: vocab sizes, hidden size, requests per captured
    graph, replays per graph (greedy and sampled in turn), logits dtypes, the sampled requests."""

    vocabs: tuple[int, ...]
    hidden: int
    batch_sizes: tuple[int, ...]
    replays: int
    dtypes: tuple[torch.dtype, ...]
    sampled: str  # the request kind of the sampled batches (verify_rounds.REQUESTS)

    @property
    def max_rows(self) -> int:
        return max(self.batch_sizes) * TOKENS


GPU_SIZES = Sizes(
    vocabs=(154880, 129281),
    hidden=512,
    batch_sizes=(1, 4, 16),
    replays=4,
    dtypes=(torch.bfloat16, torch.float32),
    sampled="top_k",
)
# SGLang renormalizes top-k probabilities with a CUDA/HIP kernel: the CPU samples without top-k.
CPU_SIZES = Sizes(
    vocabs=(1001,),
    hidden=64,
    batch_sizes=(1, 3),
    replays=4,
    dtypes=(torch.bfloat16,),
    sampled="sampled",
)


def check_route(world, route, sizes, tmp_path, timeout_s) -> list[dict]:
    """:func:`verify_routes_worker` on ``world`` ranks for ``route``, then each rank's report
    checked at ``sizes``; returns the reports."""
    run_group(verify_routes_worker, world, str(tmp_path), route, timeout_s=timeout_s)
    reports = read_reports(str(tmp_path), world)
    checks_per_forward = len(sizes.batch_sizes) * sizes.replays

    def check_rank(report, where):
        assert len(report["forwards"]) == len(sizes.vocabs) * len(sizes.dtypes), where
        for forward in report["forwards"]:
            assert forward["checked"] == checks_per_forward, f"{where}: {forward}"
            if report["not_offered"] is None:
                # At TP 1 an fp32 shard row and its token overflow a row of SGLang's fp32 logits
                # buffer: that opt-in keeps SGLang's path (kept_fit_blocker), by design.
                fp32_tp1 = world == 1 and forward["dtype"] == str(torch.float32)
                expected = (world == 1 or tp_routes.ENGAGES[route]) and not fp32_tp1
                assert forward["engaged"] is expected, f"{where}: {forward}"
                if fp32_tp1:
                    assert "do not fit" in forward["reason"], f"{where}: {forward}"
            if forward["engaged"]:
                assert forward["taken"] == [forward["route"]] * len(sizes.batch_sizes), forward
                assert forward["greedy"] > 0 and forward["full_logits"] > 0, forward
            if forward["compiles"] is not None:
                assert forward["compiles"] == [], f"{where}: compiled after the opt-in"

    return tp_routes.check_route_reports(reports, world, route, check_rank)


@pytest.mark.gpu
def test_one_gpu_replays_the_tp1_verify_exchange_in_cuda_graphs(sglang_runtime, tmp_path):
    """SGLang's group of one rank on NCCL with its defaults: the exchange engages without an
    all-reduce, and the full logits are cast into SGLang's buffer after the replay."""
    (report,) = check_route(1, "custom-ar-v2", GPU_SIZES, tmp_path, timeout_s=1200)
    engaged = [forward for forward in report["forwards"] if forward["engaged"]]
    assert [forward["dtype"] for forward in engaged] == ["torch.bfloat16"] * len(GPU_SIZES.vocabs)
    for forward in engaged:
        assert forward["route"] == "none (one rank)", forward


@pytest.mark.gpu
@pytest.mark.parametrize("route", GPU_ROUTES)
def test_verify_exchange_takes_its_route_and_verifies_sglangs_tokens_in_cuda_graphs(
    route, tp_gpus, tmp_path
):
    check_route(tp_gpus, route, GPU_SIZES, tmp_path, timeout_s=1200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_verify_exchange_holds_eagerly_in_a_cpu_tp_group(tmp_path):
    require_sglang()
    for report in check_route(2, CPU_ROUTE, CPU_SIZES, tmp_path, timeout_s=1800):
        for forward in report["forwards"]:
            assert forward["route"] == "CPU shared memory or torch.distributed", forward


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_a_full_logits_warm_up_failing_on_one_rank_stops_every_rank_before_the_same_gather(
    tmp_path,
):
    """Rank 1 cannot allocate the second warm-up shard: both ranks ran the first gather only,
    both return from the opt-in engaged (none left waiting in a gather) and both log why."""
    require_sglang()
    run_group(warm_up_failure_worker, 2, str(tmp_path), timeout_s=600)
    reports = read_reports(str(tmp_path), 2)
    for report in reports:
        assert report["engaged"], report
        assert report["gathers"] == 1, report
        assert any(
            "preparing the target verify's full-logits path ahead failed" in line
            for line in report["warnings"]
        ), report
    assert "rank 1 is out of memory" in " ".join(reports[1]["warnings"])
    assert "another TP rank" in " ".join(reports[0]["warnings"])


# --- each rank's body: run_group spawns verify_routes_worker, pickled by this module's name ---


class _FailingZeros:
    """``torch`` as the exchange module sees it, whose ``zeros`` raises at its ``fail_at``-th call."""

    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("rank 1 is out of memory")
        return torch.zeros(*args, **kwargs)


def warm_up_failure_worker(rank: int, world: int, init_method: str, result_dir: str) -> None:
    """Body of the warm-up failure test: the target's processor opted in on both ranks of SGLang's
    gloo TP group, rank 1's second warm-up shard failing; writes ``rank<r>.json``."""
    import logging

    from support.tp import sglang_tp_group

    report = dict(rank=rank, warnings=[])
    with sglang_tp_group(rank, world, init_method) as group:
        from sglang.srt.runtime_context import get_schedule, get_spec

        from sglang_dsa_mtp.integration import vocab_shard_exchange as shared
        from support.deployment import build_lm_head

        handler = logging.Handler()
        handler.emit = lambda record: report["warnings"].append(record.getMessage())
        logging.getLogger("sglang_dsa_mtp").addHandler(handler)
        eagle = dict(
            speculative_algorithm="EAGLE",
            speculative_num_steps=STEPS,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=TOKENS,
        )
        with get_spec().override(**eagle), get_schedule().override(max_running_requests=48):
            lm_head, processor, _ = build_lm_head(1001, 64, dtype=torch.bfloat16, seed=3)
            gather = processor._logits_gatherer
            report["gathers"] = 0

            def counted(shard):
                logits = gather(shard)
                report["gathers"] += 1
                return logits

            processor._logits_gatherer = counted
            if rank == 1:
                shared.torch = _FailingZeros(fail_at=2)
            try:
                decision = shared.opt_in(processor, lm_head, shared.VERIFY, max_rows=TOKENS)
            finally:
                shared.torch = torch
            report["engaged"] = decision.engaged
            group.barrier()
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


# Replay k of a graph: greedy on even k; a sampled batch on k % 4 == 1, a greedy batch with a
# logit-biased request on k % 4 == 3 (both verified on SGLang's full logits); the batch one request
# short of the graph (padded) on k % 4 >= 2.
def _round(k: int, bs: int, sampled: str) -> tuple[int, list[str]]:
    raw_bs = bs - 1 if bs > 1 and k % 4 >= 2 else bs
    if k % 2 == 0:
        return raw_bs, ["greedy"] * raw_bs
    if k % 4 == 1:
        return raw_bs, [sampled] * raw_bs
    return raw_bs, ["logit_bias"] + ["greedy"] * (raw_bs - 1)


def _verify(output, raw, verify_input, kinds, vocab, device):
    """SGLang's verify of the first ``raw`` rows, as its graph runner hands them on."""
    import dataclasses

    from support.verify_rounds import sglang_verify, verify_batch

    batch = verify_batch(kinds, vocab, device=device)
    rows = dataclasses.replace(output, next_token_logits=output.next_token_logits[:raw])
    return sglang_verify(verify_input, batch, rows, seed=raw)


class _Compiles:
    """On the GPU, every Triton compile of the blocks :meth:`counting` wraps; on the CPU nothing."""

    def __init__(self, device):
        self.names = [] if device.type == "cuda" else None

    @contextlib.contextmanager
    def counting(self):
        if self.names is None:
            yield
            return
        from support.compiles import count_compiles

        with count_compiles() as seen:
            yield
        self.names += seen.names


def _check_forwards(group, recorder, device, sizes, vocab, dtype, expect_engaged, seed):
    """One vocab and dtype: the opt-in, then each batch size's target-verify forward captured with
    the exchange (when engaged) and on SGLang's path, each replay verified by SGLang against the
    other arm. On the GPU, the exchange's captures, replays and full-logits tail at every batch
    size up to the graph's are counted for compiles."""
    from sglang.srt.runtime_context import get_spec

    from sglang_dsa_mtp.integration import vocab_shard_exchange as site
    from sglang_dsa_mtp.integration.state import ProcessorState, peek
    from support.argmax_cases import reference_pick
    from support.constants import POISON
    from support.deployment import (
        bits_differ,
        build_lm_head,
        logits_forward,
        logits_processor,
    )
    from support.verify_rounds import chain_verify_input, verify_batch

    rank, world = group.rank_in_group, group.world_size
    where = f"vocab {vocab}, {dtype}"
    lm_head, stock, _ = build_lm_head(vocab, sizes.hidden, dtype=dtype, seed=seed, device=device)
    ours = logits_processor(vocab)
    rows_of = [bs * TOKENS for bs in sizes.batch_sizes]
    decision = site.opt_in(
        ours, lm_head, site.VERIFY, max_rows=sizes.max_rows, capture_rows=rows_of
    )
    state = peek(ours, ProcessorState).verify
    result = dict(
        vocab=vocab,
        dtype=str(dtype),
        engaged=decision.engaged,
        reason=decision.reason,
        route=None if state is None else state.route,
        taken=[],
        checked=0,
        greedy=0,
        full_logits=0,
        compiles=None,
        failures=[],
    )
    failures = result["failures"]
    if decision.engaged != expect_engaged:
        failures.append(f"{where}: engaged {decision.engaged} ({decision.reason})")
    width = lm_head.num_embeddings_per_partition
    overlay = tp_routes.ShardOverlay(sizes.max_rows, world, rank, width, vocab, dtype, device)
    arms = {"stock": stock, "ours": ours} if decision.engaged else {"stock": stock}
    for processor in arms.values():
        overlay.apply_to(processor)
    compiles = _Compiles(device)
    for bs, rows in zip(sizes.batch_sizes, rows_of):
        case = f"{where}, {bs} requests"
        hidden = torch.zeros(rows, sizes.hidden, dtype=dtype, device=device)
        buffers = {name: torch.full((rows, vocab), float(POISON), device=device) for name in arms}
        replays = {}
        for name, processor in arms.items():

            def body(processor=processor, buffer=buffers[name]):
                return logits_forward(
                    processor, lm_head, hidden, mode="target_verify", logits_buffer=buffer
                )

            counted = compiles.counting() if name == "ours" else contextlib.nullcontext()
            with counted:
                replays[name], taken = tp_routes.capture_on_route(body, group, device, recorder)
            if name == "ours":
                tp_routes.record_route_taken(result, taken, state.route, case)
        for k in range(sizes.replays):
            raw_bs, kinds = _round(k, bs, sizes.sampled)
            raw = raw_bs * TOKENS
            overlay.fill(first_pattern=k * rows + bs)
            hidden.copy_(
                shared_hidden(
                    rows, sizes.hidden, seed=seed * 1000 + 31 * k + bs, dtype=dtype, device=device
                )
            )
            outputs = {}
            for name, replay in replays.items():
                counted = compiles.counting() if name == "ours" else contextlib.nullcontext()
                with counted:
                    outputs[name] = replay()
            if device.type == "cuda":
                torch.cuda.synchronize()
            gathered = outputs["stock"].next_token_logits[:raw]
            picks = torch.argmax(gathered, dim=-1).view(raw_bs, TOKENS)
            batch = verify_batch(kinds, vocab, device=device)
            verify_input = chain_verify_input(batch, steps=STEPS, predict_hint=picks, seed=k)
            verify_input.draft_probs = torch.full(
                (raw_bs, TOKENS, vocab), 1.0 / vocab, device=device
            )
            if "ours" in outputs:
                tokens = state.kept_rows(outputs["ours"].next_token_logits[:raw]).tokens
                if not torch.equal(tokens, reference_pick(gathered, vocab, "propagate")[1]):
                    failures.append(f"{case}, replay {k}: the exchanged argmax is not SGLang's")
            with get_spec().override(speculative_use_rejection_sampling=True):
                verified = {
                    name: _verify(output, raw, verify_input, kinds, vocab, device)
                    for name, output in outputs.items()
                }
            result["checked"] += 1
            if "ours" not in verified:
                continue
            for name in ("predict", "accept_lens", "accept_index", "committed"):
                problem = bits_differ(verified["ours"][name], verified["stock"][name])
                if problem:
                    failures.append(f"{case}, replay {k} ({kinds[0]}): {name}: {problem}")
            if kinds == ["greedy"] * raw_bs:
                result["greedy"] += 1
                if verified["ours"]["logits"] is not None:
                    failures.append(f"{case}, replay {k}: a greedy verify left logits")
                continue
            result["full_logits"] += 1
            problem = bits_differ(verified["ours"]["logits"], verified["stock"]["logits"])
            if problem:
                failures.append(f"{case}, replay {k}: the verify's logits: {problem}")
            problem = bits_differ(buffers["ours"][:raw], buffers["stock"][:raw])
            if problem:
                failures.append(f"{case}, replay {k}: SGLang's logits buffer rows: {problem}")
        if "ours" in outputs:
            shard = outputs["ours"].next_token_logits
            with compiles.counting():
                for raw in range(TOKENS, rows + 1, TOKENS):
                    state.full_logits(shard[:raw], state.kept_rows(shard[:raw]).start)
    if decision.engaged and compiles.names is not None:
        result["compiles"] = compiles.names
    return result


def verify_routes_worker(
    rank: int, world: int, init_method: str, result_dir: str, route_name: str
) -> None:
    """Body of the route test of the target-verify exchange, one process per rank; writes
    ``rank<r>.json``. In SGLang's TP group for ``route_name``, the plugin registered and its hooks
    applied by SGLang's ``HookRegistry``, an ``AllReduceRecorder`` on the group
    (``tp_routes.run_route_checks``), an EAGLE 4/1/5 launch of up to 48 requests and SGLang's
    verify kernels as their Triton implementations: for each vocab and dtype,
    :func:`_check_forwards`.
    On the CPU (``route_name == "gloo"``) the same runs eagerly, at :data:`CPU_SIZES`."""
    tp_routes.run_route_checks(
        rank, world, init_method, result_dir, route_name, "verify_argmax_exchange", _check_routes
    )


def _check_routes(group, device, recorder, report) -> None:
    """:func:`verify_routes_worker`'s checks in the route's group, at the route's sizes."""
    from sglang.srt.runtime_context import get_schedule, get_spec

    from sglang_dsa_mtp.integration.vocab_shard_exchange import (
        all_reduce_route,
        kept_bytes_per_row,
    )
    from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import exchange_shape
    from support.verify_rounds import verify_kernels_in_triton

    sizes = CPU_SIZES if report["route"] == CPU_ROUTE else GPU_SIZES
    world = group.world_size
    eagle = dict(
        speculative_algorithm="EAGLE",
        speculative_num_steps=STEPS,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=TOKENS,
    )
    with (
        get_spec().override(**eagle),
        get_schedule().override(max_running_requests=48),
        verify_kernels_in_triton(),
    ):
        for i, vocab in enumerate(sizes.vocabs):
            width = padded_shard_width(vocab, world)
            nccl = any(
                all_reduce_route(
                    group, torch.empty(exchange_shape(rows, width, world), device=device)
                )[1]
                for rows in (1, sizes.max_rows)
            )
            for j, dtype in enumerate(sizes.dtypes):
                # An fp32 shard at TP 1 and its tokens do not fit a row of the buffer.
                fits = kept_bytes_per_row(width, dtype) <= vocab * 4
                result = _check_forwards(
                    group, recorder, device, sizes, vocab, dtype, fits and not nccl, 10 * i + j
                )
                report["failures"] += result.pop("failures")
                report["forwards"].append(result)
