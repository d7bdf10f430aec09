"""The target-verify argmax exchange on SGLang's real classes, in one CPU process.

Through SGLang's real plugin loader (``hooked``): the EAGLE v2 worker's opt-in (SGLang's
``EAGLEWorkerV2.init_attention_backends`` as its ``HookRegistry`` patched it), the target model's
``LogitsProcessor`` and ``ParallelLMHead`` at TP 1 and as rank 1 of an emulated TP 2 group
(``conftest.EmulatedPeerGroup``, rank 0 computed by SGLang's own LM-head path), SGLang's EAGLE
verify (``eagle_sample``, its greedy tree verify and rejection sampler through their Triton
implementations) and its target-verify graph runner's ``execute``. Each round runs the same hidden
states through a processor that opted in and one that did not (SGLang's path), with the hard rows
of ``argmax_cases`` (ties, NaN, infinities, signed zeros, padding specials) written over the LM-head
shards, and compares predict, accept lengths, accept index and the committed tokens, and on every
batch that needs them the full logits, bit for bit. The real two-process group (gloo) and the CUDA
graphs are ``test_verify_argmax_exchange_sglang_tp.py``.
"""

import logging
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

from support.sglang_import import require_sglang

require_sglang()

import torch
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative import spec_utils
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
from sglang.srt.speculative.standalone_worker_v2 import StandaloneWorkerV2

from sglang_dsa_mtp.integration import eagle_argmax as worker_site
from sglang_dsa_mtp.integration import vocab_shard_exchange as processor_site
from sglang_dsa_mtp.integration.state import ProcessorState, peek
from sglang_dsa_mtp.switches import VERIFY_ARGMAX_EXCHANGE
from support.argmax_cases import make_overlay
from support.constants import POISON
from support.deployment import bits_differ
from support.verify_rounds import (
    chain_verify_input,
    sglang_verify,
    verify_batch,
    verify_kernels_in_triton,
)

STEPS = 4  # EAGLE 4/1/5: 5 verify rows per request
TOKENS = STEPS + 1
CAPTURE_BS = [1, 2, 4, 8]  # the target-verify graphs' batch sizes in these tests
VERIFIED = ("predict", "accept_lens", "accept_index", "committed")


def log_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "sglang_dsa_mtp"]


def verify_exchange(processor):
    """The processor's engaged target-verify exchange, or None."""
    return peek(processor, ProcessorState).verify


def engaged(processor) -> bool:
    return verify_exchange(processor) is not None


@pytest.fixture
def verify_kernels(hooked):
    with verify_kernels_in_triton():
        yield hooked


def eagle_worker(target, cls=EAGLEWorkerV2):
    """SGLang's EAGLE v2 worker (built without its constructor) holding the target worker of
    ``target``'s deployment and a draft worker whose attention backends build nothing."""
    worker = object.__new__(cls)
    worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace(model=target.model))
    worker._draft_worker = SimpleNamespace(init_attention_backends=lambda: None)
    worker.speculative_num_draft_tokens = TOKENS
    return worker


@pytest.fixture
def opted_in(hooked, target_head):
    """``opted_in(**options)``: a ``target_head`` whose EAGLE worker ran SGLang's
    ``init_attention_backends`` (the plugin's AFTER hook opts the target in), and that worker."""
    hooked.setattr(
        worker_site, "get_batch_sizes_to_capture", lambda runner, width: (CAPTURE_BS, None)
    )

    def build(**options):
        target = target_head(**options)
        worker = eagle_worker(target)
        worker.init_attention_backends()
        return target, worker

    return build


class Patterns:
    """:func:`argmax_cases.make_overlay`'s hard rows over every LM-head shard a processor computes:
    each head gets its own columns of the global pattern (rank r's from ``r * width``)."""

    def __init__(self, target, rows: int):
        width = target.lm_head.num_embeddings_per_partition
        self.shape = (rows, target.group.world_size, width, target.vocab_size)
        self.width, self.dtype = width, target.lm_head.weight.dtype
        self.values = torch.zeros(rows, target.group.world_size * width, dtype=self.dtype)
        self.defined = torch.zeros(self.values.shape, dtype=torch.bool)

    def fill(self, first_pattern: int) -> list[str]:
        values, defined, names = make_overlay(*self.shape, first_pattern=first_pattern)
        self.values.copy_(values.to(self.dtype))
        self.defined.copy_(defined)
        return names

    def apply_to(self, processor) -> None:
        compute = processor._compute_lm_head

        def with_patterns(hidden_states, lm_head, *args, **kwargs):
            logits = compute(hidden_states, lm_head, *args, **kwargs)
            start = lm_head.shard_indices.padded_org_vocab_start_index
            columns = slice(start, start + self.width)
            rows = logits.shape[0]
            values = self.values[:rows, columns].to(logits.dtype)
            return torch.where(self.defined[:rows, columns], values, logits)

        processor._compute_lm_head = with_patterns


def poisoned_buffer(rows, vocab):
    return torch.full((rows, vocab), float(POISON), dtype=torch.float32)


def hidden_rows(rows, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=generator).to(dtype)


def verify_round(
    target, kinds, *, seed, patterns=None, first_pattern=0, return_logprob=False, grammar_mask=None
):
    """One verify round of ``kinds`` requests through SGLang's path (``target.stock``) and the
    exchange (``target.processor``): ``(stock, ours)``, each SGLang's verify outcome
    (:func:`sglang_verify`) plus ``buffer``, its call's fp32 logits buffer after the round."""
    bs, vocab = len(kinds), target.vocab_size
    rows = bs * TOKENS
    if patterns is not None:
        patterns.fill(first_pattern)
    hidden = hidden_rows(rows, seed, target.lm_head.weight.dtype)
    outcomes = []
    for processor in (target.stock, target.processor):
        batch = verify_batch(kinds, vocab, return_logprob=return_logprob)
        buffer = poisoned_buffer(rows, vocab)
        output = target.forward(processor, hidden, buffer)
        if not outcomes:  # the stock arm: drafts that the target accepts in part
            picks = torch.argmax(output.next_token_logits, dim=-1).view(bs, TOKENS)
            verify_input = chain_verify_input(batch, steps=STEPS, predict_hint=picks, seed=seed)
            verify_input.draft_probs = torch.full((bs, TOKENS, vocab), 1.0 / vocab)
        outcome = sglang_verify(verify_input, batch, output, grammar_mask=grammar_mask, seed=seed)
        outcomes.append(dict(outcome, buffer=buffer))
    return tuple(outcomes)


def assert_same_verify(stock, ours, where=""):
    for name in VERIFIED:
        problem = bits_differ(ours[name], stock[name])
        assert problem is None, f"{where} {name}: {problem}"


# --- the worker's opt-in -------------------------------------------------------------------------


@pytest.mark.quick
def test_sglangs_eagle_worker_opts_its_target_in_before_any_capture(opted_in, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in()
    assert engaged(target.processor)
    assert not engaged(target.stock)
    assert log_lines(caplog) == [
        "sglang_dsa_mtp: verify_argmax_exchange on: greedy target verify takes its argmax from "
        "exchanged argmax partials (target model DeepseekV32ForCausalLM, tp size 2, LM-head quant "
        "method UnquantizedEmbeddingMethod (not applied by SGLang), head dtype bfloat16, verify "
        "rows up to 40, all-reduce CPU shared memory or torch.distributed, kernel variants "
        "compiled ahead 3)"
    ]


def test_the_opt_in_compiles_for_the_captured_verify_rows_and_builds_the_full_logits_tail(
    hooked, opted_in
):
    calls = []
    real = processor_site.warm_up
    hooked.setattr(processor_site, "warm_up", lambda **kw: calls.append(kw) or real(**kw))
    target, _ = opted_in()
    [call] = calls
    assert call == dict(
        rows=[1, *(bs * TOKENS for bs in CAPTURE_BS)],
        shard_width=target.lm_head.num_embeddings_per_partition,
        tp_size=2,
        vocab_size=target.vocab_size,
        dtypes=(torch.bfloat16,),
        device=target.lm_head.weight.device,
        draft_steps=None,
    )
    assert target.group.calls.count("all_gather") == len(processor_site.FULL_LOGITS_WARM_UP_ROWS)
    assert "all_reduce" not in target.group.calls, "the kernels' warm-up runs no collective"


def stages(pp_size: int):
    """SGLang's parallel context as a pipeline of ``pp_size`` stages sees it (the same TP group)."""
    real = worker_site.get_parallel()
    return lambda: SimpleNamespace(pp_size=pp_size, tp_group=real.tp_group)


@pytest.mark.parametrize(
    "setup, expected",
    [
        (lambda w, mp: mp.setenv(VERIFY_ARGMAX_EXCHANGE.env, "0"), "=0"),
        (
            lambda w, mp: mp.setattr(worker_site, "why_off", lambda s: "not a CUDA platform"),
            "not a CUDA platform",
        ),
        (
            lambda w, mp: mp.setattr(w, "__class__", StandaloneWorkerV2),
            "not SGLang's EAGLEWorkerV2",
        ),
        (
            lambda w, mp: mp.setattr(worker_site, "get_parallel", stages(2)),
            "pipeline parallelism",
        ),
        (
            lambda w, mp: mp.setattr(
                worker_site, "get_spec", lambda: SimpleNamespace(speculative_adaptive=True)
            ),
            "adaptive speculation",
        ),
        (
            lambda w, mp: mp.setattr(
                worker_site,
                "get_flags",
                lambda: SimpleNamespace(capture=SimpleNamespace(enable_torch_compile=True)),
            ),
            "torch.compile",
        ),
        (lambda w, mp: mp.setattr(spec_utils, "SIMULATE_ACC_LEN", 3.0), "SGLANG_SIMULATE_ACC_LEN"),
        (
            lambda w, mp: mp.setattr(
                w._target_worker.model_runner,
                "model",
                SimpleNamespace(logits_processor=None, lm_head=None),
            ),
            "is not one whose forward hands the processor's output on untouched",
        ),
    ],
    ids=[
        "switch-off",
        "not-cuda",
        "standalone-worker",
        "pipeline",
        "adaptive",
        "torch-compile",
        "simulated-acceptance",
        "other-target-model",
    ],
)
def test_a_worker_whose_verify_cannot_take_the_exchange_keeps_sglangs_path(
    setup, expected, hooked, target_head, caplog
):
    hooked.setattr(
        worker_site, "get_batch_sizes_to_capture", lambda runner, width: (CAPTURE_BS, None)
    )
    target = target_head()
    worker = eagle_worker(target)
    setup(worker, hooked)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        worker_site.opt_in_target_model(None, worker)
    assert not engaged(target.processor)
    [line] = log_lines(caplog)
    assert line.startswith(
        "sglang_dsa_mtp: verify_argmax_exchange off: target verify keeps SGLang's full logits: "
    )
    assert expected in line


@pytest.mark.parametrize("probe", worker_site.LOGIT_PROBES)
def test_sglang_logit_probes_keep_sglangs_path(probe, opted_in, caplog):
    with getattr(envs, probe).override(True):
        with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
            target, _ = opted_in()
    assert not engaged(target.processor)
    assert any(f"{probe} is on" in line for line in log_lines(caplog))


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(final_logit_softcapping=30.0), "softcapping"),
        (dict(enable_dp_lm_head=True), "DP LM head"),
        (dict(attn_dp_size=2), "DP attention"),
        (dict(enable_tp_lm_head_all_to_all=True), "LM-head all-to-all"),
        (dict(checkpoint="modelopt_fp8_quantized_lm_head"), "SGLang applies the LM head's quant"),
        (dict(dtype=torch.float16), "the partials take bf16 or fp32"),
    ],
    ids=[
        "softcapping",
        "dp-lm-head",
        "dp-attention",
        "lm-head-all-to-all",
        "quantized-lm-head",
        "fp16-head",
    ],
)
def test_each_failing_processor_condition_keeps_sglangs_path_and_names_why(
    options, expected, opted_in, caplog
):
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in(**options)
    assert not engaged(target.processor)
    [line] = log_lines(caplog)
    assert "keeps SGLang's full logits" in line and expected in line


def test_a_softcapping_target_logs_the_fact_that_kept_sglangs_path(opted_in, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        opted_in(final_logit_softcapping=30.0)
    assert log_lines(caplog) == [
        "sglang_dsa_mtp: verify_argmax_exchange off: target verify keeps SGLang's full logits: "
        "final-logit softcapping: SGLang gathers fp32 logits and caps them in a fused kernel "
        "(target model DeepseekV32ForCausalLM, tp size 2, LM-head quant method "
        "UnquantizedEmbeddingMethod (not applied by SGLang), head dtype bfloat16, verify rows up "
        "to 40)"
    ]


def test_an_fp32_lm_head_at_tp1_keeps_sglangs_path(hooked, target_head, caplog):
    hooked.setattr(
        worker_site, "get_batch_sizes_to_capture", lambda runner, width: (CAPTURE_BS, None)
    )
    target = target_head(tp_size=1)
    target.processor.use_fp32_lm_head_output = True
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        eagle_worker(target).init_attention_backends()
    assert not engaged(target.processor)
    assert any(
        "fp32 LM head writes its logits into the fp32 buffer" in m for m in log_lines(caplog)
    )


def test_an_all_reduce_on_nccl_inside_capture_keeps_sglangs_path(hooked, opted_in, caplog):
    hooked.setattr(
        processor_site, "all_reduce_route", lambda group, probe: ("pynccl (in place)", True)
    )
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in()
    assert not engaged(target.processor)
    assert any("would run on NCCL (pynccl (in place))" in m for m in log_lines(caplog))


def test_an_opt_in_check_that_raises_keeps_sglangs_path(hooked, opted_in, caplog):
    def broken(*args):
        raise RuntimeError("cannot tell")

    hooked.setattr(processor_site, "_local_blocker", broken)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in()
    assert not engaged(target.processor)
    assert any("the opt-in check raised RuntimeError: cannot tell" in m for m in log_lines(caplog))


def test_a_hook_sglang_failed_to_apply_keeps_sglangs_path(hooked, opted_in, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    verify = "sglang.srt.speculative.eagle_utils.eagle_sample"
    hooked.setattr(HookRegistry, "_patched", HookRegistry._patched - {verify})
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in()
    assert not engaged(target.processor)
    assert any(f"did not apply the plugin's hooks on {verify}" in m for m in log_lines(caplog))


def test_an_engaged_target_stays_engaged_when_sglang_builds_the_backends_again(hooked, opted_in):
    target, worker = opted_in()
    hooked.setattr(processor_site, "all_reduce_route", lambda group, probe: ("pynccl", True))
    worker.init_attention_backends()
    assert engaged(target.processor), "graphs captured with the exchange are still replayed"


def test_the_draft_exchange_leaves_the_target_alone_and_the_verify_exchange_the_draft(opted_in):
    target, _ = opted_in()
    assert peek(target.processor, ProcessorState).draft is None
    assert not engaged(
        target.deployment.processor
    ), "the draft model's processor is not the target's"


# --- the verify: greedy batches ------------------------------------------------------------------


def kept_region_elements(buffer, width, dtype) -> int:
    """The fp32 elements of a ``[rows, vocab]`` logits buffer that hold its rows' kept shard and
    their tokens (the tokens after the shard of every row of the buffer's storage)."""
    rows = buffer.untyped_storage().nbytes() // (buffer.shape[1] * 4)
    shard_bytes = rows * width * dtype.itemsize
    return -(-(-(-shard_bytes // 8) * 8 + rows * 8) // 4)


@pytest.mark.parametrize(
    "tp_size, dtype",
    [(1, torch.bfloat16), (2, torch.bfloat16), (2, torch.float32)],
    ids=["tp1-bf16", "tp2-bf16", "tp2-fp32"],
)
def test_greedy_batches_verify_sglangs_tokens_from_the_exchanged_argmax(
    tp_size, dtype, opted_in, verify_kernels
):
    """Vocab 1001 padded to 1024 (at TP 2: two 512-column shards, the second holding 489 real
    columns): three rounds of the hard rows; the exchange gathers nothing, writes no logits and
    keeps its shard and tokens inside the call's logits buffer, the rest of it untouched."""
    target, _ = opted_in(tp_size=tp_size, dtype=dtype)
    assert engaged(target.processor)
    patterns = Patterns(target, 4 * TOKENS)
    for processor in (target.stock, target.processor):
        patterns.apply_to(processor)
    for k in range(3):
        target.group.calls.clear()
        stock, ours = verify_round(
            target, ["greedy"] * 4, seed=10 * k + tp_size, patterns=patterns, first_pattern=20 * k
        )
        assert_same_verify(stock, ours, f"round {k}")
        assert ours["logits"] is None, "no logits after a greedy verify of the exchange"
        width = target.lm_head.num_embeddings_per_partition
        untouched = ours["buffer"].view(-1)[kept_region_elements(ours["buffer"], width, dtype) :]
        assert untouched.numel() > 0 and bool((untouched == POISON).all()), "no logits written"
        assert bool((stock["buffer"] != POISON).all()), "SGLang's path cast into its buffer"
        gathers = target.group.calls.count("all_gather")
        assert gathers == (tp_size - 1), "only SGLang's arm gathered"


def test_an_fp32_shard_at_tp1_does_not_fit_the_logits_buffer_and_keeps_sglangs_path(
    opted_in, caplog
):
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        target, _ = opted_in(tp_size=1, dtype=torch.float32)
    assert not engaged(target.processor)
    assert any(
        "a float32 shard row of 1024 columns and its token do not fit a 1001-column fp32 row" in m
        for m in log_lines(caplog)
    )


def test_the_kept_shard_and_its_tokens_live_in_the_calls_logits_buffer(opted_in):
    """No memory of the call's own: the returned shard and the tokens are views of the buffer's
    storage, the tokens at the same place whatever the row count."""
    target, _ = opted_in(tp_size=1)
    buffer = poisoned_buffer(4 * TOKENS, target.vocab_size)
    places = []
    for rows in (2 * TOKENS, 4 * TOKENS):
        shard = target.forward(
            target.processor, hidden_rows(rows, 3, torch.bfloat16), buffer[:rows]
        )
        shard = shard.next_token_logits
        assert shard.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        kept = verify_exchange(target.processor).kept_rows(shard)
        assert kept.start == 0 and kept.tokens.untyped_storage().data_ptr() == buffer.data_ptr()
        places.append(kept.tokens.data_ptr())
    assert places[0] == places[1]


def test_a_call_without_a_logits_buffer_keeps_sglangs_full_logits(opted_in, caplog):
    """An eager target verify (SGLang's runners give a buffer only to captured graphs; its
    --debug-tensor-dump-output-folder disables them): SGLang's logits, which its dump then reads."""
    target, _ = opted_in()
    hidden = hidden_rows(2 * TOKENS, 8, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        ours = target.forward(target.processor, hidden).next_token_logits
    stock = target.forward(target.stock, hidden).next_token_logits
    assert verify_exchange(target.processor).kept_rows(ours) is None
    assert bits_differ(ours, stock) is None
    assert any(
        "a target verify keeps SGLang's full logits: the call has no logits buffer" in m
        for m in log_lines(caplog)
    )


def test_a_logit_scale_is_applied_before_the_partials(opted_in, verify_kernels):
    target, _ = opted_in(logit_scale=0.37)
    stock, ours = verify_round(target, ["greedy"] * 3, seed=5)
    assert_same_verify(stock, ours)


# --- the verify: every other batch gets SGLang's full logits ---------------------------------------


def mask_every_seventh_token(logits):
    logits[:, ::7] = float("-inf")


@pytest.mark.parametrize(
    "kinds, options",
    [
        (["sampled", "sampled", "sampled"], {}),
        (["greedy", "logit_bias", "greedy"], {}),
        (["penalties", "greedy", "greedy"], {}),
        (["greedy", "greedy", "greedy"], dict(return_logprob=True)),
        (
            ["greedy", "greedy", "greedy"],
            dict(grammar_mask=SimpleNamespace(apply=mask_every_seventh_token)),
        ),
    ],
    ids=["sampled", "logit-bias", "penalties", "return-logprob", "grammar-mask"],
)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_any_other_batch_gets_sglangs_full_logits_bit_for_bit(
    kinds, options, tp_size, opted_in, verify_kernels
):
    target, _ = opted_in(tp_size=tp_size)
    patterns = Patterns(target, len(kinds) * TOKENS)
    for processor in (target.stock, target.processor):
        patterns.apply_to(processor)
    with get_spec().override(speculative_use_rejection_sampling=True):
        stock, ours = verify_round(
            target, kinds, seed=7, patterns=patterns, first_pattern=3, **options
        )
    assert_same_verify(stock, ours)
    assert bits_differ(ours["logits"], stock["logits"]) is None
    assert bits_differ(ours["buffer"], stock["buffer"]) is None, "the whole logits buffer"


@pytest.mark.parametrize(
    "info_field, value",
    [("has_custom_logit_processor", True), ("has_watermark_candidates", True)],
)
def test_custom_logit_processors_and_watermarks_get_the_full_logits(
    info_field, value, opted_in, hooked
):
    target, _ = opted_in()
    batch = verify_batch(["greedy"] * 2, target.vocab_size)
    setattr(batch.sampling_info, info_field, value)
    hidden = hidden_rows(2 * TOKENS, 3, torch.bfloat16)
    stock = target.forward(target.stock, hidden, poisoned_buffer(2 * TOKENS, target.vocab_size))
    ours = target.forward(target.processor, hidden, poisoned_buffer(2 * TOKENS, target.vocab_size))
    seen = []
    worker_site.verify_sample(
        lambda verify_input, batch, output, *a, **kw: seen.append(output.next_token_logits),
        None,
        batch,
        ours,
        None,
        watermark_state=object(),
    )
    assert bits_differ(seen[0], stock.next_token_logits) is None


def test_rounds_switch_between_the_exchange_and_the_full_logits(opted_in, verify_kernels):
    """Greedy and other batches in turn on the same processors: each round is SGLang's."""
    target, _ = opted_in()
    patterns = Patterns(target, 3 * TOKENS)
    for processor in (target.stock, target.processor):
        patterns.apply_to(processor)
    rounds = [
        ["greedy"] * 3,
        ["sampled"] * 3,
        ["greedy"] * 3,
        ["logit_bias", "greedy", "greedy"],
        ["greedy"] * 3,
    ]
    with get_spec().override(speculative_use_rejection_sampling=True):
        for k, kinds in enumerate(rounds):
            stock, ours = verify_round(target, kinds, seed=k, patterns=patterns, first_pattern=k)
            assert_same_verify(stock, ours, f"round {k} {kinds}")
            if kinds == ["greedy"] * 3:
                assert ours["logits"] is None
            else:
                assert bits_differ(ours["logits"], stock["logits"]) is None, f"round {k}"


# --- the target-verify graph runner's replay --------------------------------------------------------


def graph_runner(target, processor, captured_bs):
    """SGLang's ``DecodeCudaGraphRunner`` in target verify (built without a model runner): its
    replay returns what the graph of ``captured_bs`` requests returns, the processor's forward on
    its padded hidden states into its slice of one shared fp32 logits buffer (SGLang's
    ``GraphSharedOutput``); its batch loading records the batch's raw rows."""
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    runner = object.__new__(DecodeCudaGraphRunner)
    rows = captured_bs * TOKENS
    runner.hidden = torch.zeros(rows, 64, dtype=target.lm_head.weight.dtype)
    runner.logits_buffer = poisoned_buffer(rows, target.vocab_size)
    runner.model_runner = SimpleNamespace(
        device_timer=None, model=SimpleNamespace(shared_experts_config=None)
    )
    runner.attn_backend = SimpleNamespace(shared_read_ends=lambda mode: SharedReadEnds.UNKNOWN)
    runner.enable_pdmux = runner.is_dllm = False

    def load_batch(forward_batch, pp_proxy_tensors=None):
        runner.raw_num_token = forward_batch.hidden.shape[0]
        runner.hidden.zero_()
        runner.hidden[: runner.raw_num_token] = forward_batch.hidden
        runner._replay_graph_key = captured_bs

    def replay(key, forward_batch):
        return target.forward(processor, runner.hidden, runner.logits_buffer)

    runner.load_batch = load_batch
    runner.backend = SimpleNamespace(replay_session=nullcontext, replay=replay)
    return runner


def test_sglangs_graph_runner_hands_on_the_kept_shard_of_the_batch_rows(opted_in, verify_kernels):
    """3 requests replayed in the graph of 4: SGLang's runner slices the output to the batch's
    rows; the exchange's verify is SGLang's, greedy and not, and its full logits are SGLang's rows
    of the buffer (the padding rows, which nothing reads, are left as they were)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    target, _ = opted_in()
    raw = 3 * TOKENS
    hidden = hidden_rows(raw, 11, torch.bfloat16)
    forward_batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, hidden=hidden)
    runners = {
        name: graph_runner(target, p, 4)
        for name, p in (("stock", target.stock), ("ours", target.processor))
    }
    with get_spec().override(speculative_use_rejection_sampling=True):
        for kinds in (["greedy"] * 3, ["sampled"] * 3):
            outcomes = {}
            for name, runner in runners.items():
                output = runner.execute(forward_batch)
                target.group.hidden = hidden  # the peer's rows of the full-logits gather
                assert output.next_token_logits.shape[0] == raw
                batch = verify_batch(kinds, target.vocab_size)
                if name == "stock":
                    picks = torch.argmax(output.next_token_logits, -1).view(3, TOKENS)
                    verify_input = chain_verify_input(batch, steps=STEPS, predict_hint=picks)
                    verify_input.draft_probs = torch.full((3, TOKENS, target.vocab_size), 1e-3)
                outcomes[name] = sglang_verify(verify_input, batch, output)
            assert_same_verify(outcomes["stock"], outcomes["ours"], str(kinds))
            if "sampled" in kinds:
                ours_rows = runners["ours"].logits_buffer[:raw]
                assert bits_differ(ours_rows, runners["stock"].logits_buffer[:raw]) is None
                assert bool((runners["ours"].logits_buffer[raw:] == POISON).all())


# --- the kept shard and the hooks' pass-through -----------------------------------------------------


def test_a_kept_shard_is_found_from_its_row_slices_only(opted_in):
    target, _ = opted_in()
    hidden = hidden_rows(10, 1, torch.bfloat16)
    buffer = poisoned_buffer(10, target.vocab_size)
    shard = target.forward(target.processor, hidden, buffer).next_token_logits
    verify = verify_exchange(target.processor)
    kept = verify.kept_rows(shard[4:9])
    assert (kept.start, verify.placement.capacity) == (4, 10)
    assert verify.placement.width == target.lm_head.num_embeddings_per_partition
    assert verify.kept_rows(shard.clone()) is None
    assert verify.kept_rows(torch.zeros(10, 4)) is None
    assert verify.kept_rows(shard[:, :7]) is None
    assert verify.kept_rows(buffer) is None, "SGLang's own logits in that buffer"


def test_a_freed_shard_is_forgotten(opted_in):
    target, _ = opted_in()
    buffer = poisoned_buffer(5, target.vocab_size)
    target.forward(target.processor, hidden_rows(5, 1, torch.bfloat16), buffer)
    key = processor_site.StorageWeakRef(buffer.untyped_storage())
    verify = verify_exchange(target.processor)
    assert verify.placement.storage == key
    del buffer
    target.forward(  # keeps into another buffer, forgets the freed one
        target.processor, hidden_rows(5, 2, torch.bfloat16), poisoned_buffer(5, 1001)
    )
    assert verify.placement.storage != key


def test_the_kept_shard_and_its_verify_work_under_inference_mode(opted_in, verify_kernels):
    """SGLang's scheduler may run under torch.inference_mode, where views record no base: the
    graph runner's row slice must still lead to the kept shard once the output is dropped."""
    target, _ = opted_in()
    hidden = hidden_rows(2 * TOKENS, 4, torch.bfloat16)
    stock_output = target.forward(target.stock, hidden, poisoned_buffer(2 * TOKENS, 1001))
    buffer = poisoned_buffer(2 * TOKENS, 1001)
    with torch.inference_mode():
        output = target.forward(target.processor, hidden, buffer)
        rows = output.next_token_logits[: 2 * TOKENS]
        del output
        tokens = verify_exchange(target.processor).kept_rows(rows).tokens
    want = torch.argmax(stock_output.next_token_logits, dim=-1, keepdim=True)
    assert torch.equal(tokens, want)


def test_other_calls_of_an_engaged_target_keep_sglangs_logits(opted_in):
    target, _ = opted_in()
    hidden = hidden_rows(3, 9, torch.bfloat16)
    from support.deployment import logits_forward

    for mode in ("decode", "draft_extend_v2"):
        target.group.hidden = hidden
        ours = logits_forward(target.processor, target.lm_head, hidden, mode=mode)
        stock = logits_forward(target.stock, target.lm_head, hidden, mode=mode)
        assert bits_differ(ours.next_token_logits, stock.next_token_logits) is None, mode


def test_real_logits_reach_sglangs_verify_untouched(hooked):
    logits = torch.randn(5, 50)
    output = SimpleNamespace(next_token_logits=logits)
    calls = []
    assert (
        worker_site.verify_sample(
            lambda *args, **kwargs: calls.append(args) or "sglang", "input", "batch", output
        )
        == "sglang"
    )
    assert calls[0][2].next_token_logits is logits


def test_the_tree_verify_gets_sglangs_target_predict_outside_an_exchanged_verify(hooked):
    calls = []
    predict = torch.zeros(2, 3, dtype=torch.int64)
    worker_site.greedy_verify_pick(lambda **kw: calls.append(kw), target_predict=predict)
    assert calls[0]["target_predict"] is predict


def test_one_hook_serves_both_exchanges_on_get_logits():
    from sglang_dsa_mtp import hooks
    from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE

    [row] = [r for r in hooks.HOOKS if r.target.endswith("LogitsProcessor._get_logits")]
    assert row.switches == (DRAFT_ARGMAX_EXCHANGE, VERIFY_ARGMAX_EXCHANGE)
    assert row.hook.endswith("vocab_shard_exchange:exchange_logits")
