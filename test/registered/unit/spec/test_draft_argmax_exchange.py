"""The greedy-draft argmax exchange's opt-in protocol and per-call gate, on SGLang's real classes.

Everything runs in one CPU process through SGLang's real plugin loader (``hooked``), with SGLang's
``LogitsProcessor`` and ``ParallelLMHead`` built as TP rank 1 of 2 and the other rank emulated
(``conftest.EmulatedPeerGroup``); kernels run under Triton's interpreter. The real two-process TP
group is in ``test_draft_argmax_exchange_cpu_tp.py`` (CPU) and
``kernels/ops/speculative/test_draft_argmax_exchange_tp.py`` (two GPUs).
"""

import copy
import inspect
import logging
from types import SimpleNamespace
from unittest import mock

import pytest

from support.sglang_import import require_sglang

require_sglang()

import torch
from sglang.kernels.ops.speculative.topk1 import draft_topk1_postprocess
from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLMNextN

from sglang_dsa_mtp.integration import eagle_argmax as worker_site
from sglang_dsa_mtp.integration import vocab_shard_exchange as shared_exchange
from sglang_dsa_mtp.integration.state import ProcessorState, peek
from sglang_dsa_mtp.kernels.ops.speculative.draft_argmax_partials import draft_argmax_finalize
from sglang_dsa_mtp.switches import DRAFT_ARGMAX_EXCHANGE

ROWS = 5
CAPTURE_BS = [1, 2, 4, 8]  # the draft worker's captured batch sizes in these tests


def hidden(rows=ROWS, seed=1, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=generator).to(dtype)


def log_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "sglang_dsa_mtp"]


def draft_exchange(processor):
    """The processor's engaged draft exchange, or None."""
    return peek(processor, ProcessorState).draft


def engaged(processor) -> bool:
    return draft_exchange(processor) is not None


# --- the processor's opt-in ------------------------------------------------------------------------


def test_logits_processor_output_defaults_the_partials_field_to_none(hooked):
    output = LogitsProcessorOutput(next_token_logits=torch.zeros(1, 4))
    assert output.next_token_argmax_partials is None


@pytest.mark.quick
def test_opt_in_engages_when_every_condition_holds(hooked, draft_head, caplog):
    head = draft_head()
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head, max_rows=16) is True
    assert engaged(head.processor)
    assert any("exchanges argmax partials" in line for line in log_lines(caplog))


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(tp_size=1), "does not gather logits across TP ranks"),
        (dict(skip_all_gather=True), "does not gather logits across TP ranks"),
        (dict(enable_dp_lm_head=True), "DP LM head"),
        (dict(attn_dp_size=2), "DP attention"),
        (dict(enable_tp_lm_head_all_to_all=True), "LM-head all-to-all"),
        (dict(final_logit_softcapping=30.0), "softcapping"),
        (dict(added_vocab=16), "added (LoRA) vocab"),
        (dict(dtype=torch.float16), "the partials take bf16 or fp32"),
    ],
    ids=[
        "tp1",
        "skip-all-gather",
        "dp-lm-head",
        "dp-attention",
        "lm-head-all-to-all",
        "softcapping",
        "added-vocab",
        "fp16-head",
    ],
)
def test_each_failing_condition_keeps_the_gather_and_names_why(
    options, expected, hooked, draft_head, caplog
):
    head = draft_head(**options)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert not engaged(head.processor)
    [line] = [line for line in log_lines(caplog) if "keeps the logits gather" in line]
    assert expected in line


def test_a_lora_wrapped_head_keeps_the_gather(hooked, draft_head, caplog):
    head = draft_head()
    head.lm_head.set_lora = lambda *args: None
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert any("LoRA-wrapped" in line for line in log_lines(caplog))


# --- quantized checkpoints: engaged where SGLang's LM-head path is a plain matmul -----------------


def sglang_applies_quant_method(head) -> bool:
    """Whether SGLang's own ``LogitsProcessor._compute_lm_head`` calls the head's quant method
    (its ``apply`` is recorded, not run: the quantized kernels need a GPU)."""
    calls = []

    def record(method, layer, x, bias=None):
        calls.append(type(method).__name__)
        return torch.zeros(x.shape[0], layer.num_embeddings_per_partition)

    with mock.patch.object(type(head.lm_head.quant_method), "apply", record):
        head.processor._compute_lm_head(hidden(rows=1), head.lm_head, None)
    return bool(calls)


# checkpoint (support.deployment.CHECKPOINTS) -> the draft head's quant method as SGLang builds it.
PLAIN_MATMUL_HEADS = {
    "unquantized": "UnquantizedEmbeddingMethod",
    "fp8_block": "UnquantizedEmbeddingMethod",
    "modelopt_fp4": "ModelOptFp4LinearMethod",
    "modelopt_fp4_head_excluded": "UnquantizedLinearMethod",
    "modelopt_fp8": "ModelOptFp8LinearMethod",
}


@pytest.mark.parametrize("checkpoint, quant_method", PLAIN_MATMUL_HEADS.items())
def test_a_draft_head_sglang_runs_as_a_plain_matmul_engages_and_picks_sglangs_tokens(
    checkpoint, quant_method, hooked, draft_head, caplog
):
    head = draft_head(checkpoint=checkpoint)
    assert type(head.lm_head.quant_method).__name__ == quant_method
    assert head.lm_head.weight is head.target.lm_head.weight, "SGLang shared the target's head"
    assert head.lm_head.weight.dtype == torch.bfloat16
    assert not sglang_applies_quant_method(head)
    states = hidden(rows=3)
    off = head.forward(states)
    assert torch.equal(off.next_token_logits, head.gathered_logits(states))

    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head, max_rows=8)
    [line] = log_lines(caplog)
    assert f"LM-head quant method {quant_method} (not applied by SGLang)" in line
    on = head.forward(states)
    assert on.next_token_argmax_partials is not None

    positions = torch.zeros(3, dtype=torch.int64)
    _, ours = worker_site.draft_decode_pick(
        draft_topk1_postprocess, on.next_token_logits, positions.clone()
    )
    _, sglang = draft_topk1_postprocess(off.next_token_logits, positions.clone())
    assert torch.equal(ours, sglang), "draft decode: draft_topk1_postprocess's token"
    _, ours = draft_argmax_finalize(on.next_token_argmax_partials, nan_policy="propagate")
    sglang = torch.argmax(off.next_token_logits, dim=-1, keepdim=True)
    assert torch.equal(ours, sglang), "draft extend: torch.argmax's token"


def test_a_draft_head_whose_quant_method_sglang_applies_keeps_the_gather(
    hooked, draft_head, caplog
):
    head = draft_head(checkpoint="modelopt_fp8_quantized_lm_head")
    assert type(head.lm_head.quant_method).__name__ == "ModelOptFp8LinearMethod"
    assert head.lm_head.weight is head.target.lm_head.weight
    assert head.lm_head.weight.dtype == torch.float8_e4m3fn
    assert sglang_applies_quant_method(head), "SGLang runs ModelOpt's FP8 LM-head kernel"
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert not engaged(head.processor)
    [line] = log_lines(caplog)
    assert (
        "keeps the logits gather: SGLang applies the LM head's quant method "
        "ModelOptFp8LinearMethod (a quantized LM-head kernel)" in line
    )


def test_the_gate_asks_the_quant_rule_sglangs_lm_head_path_calls(hooked):
    """SGLang's logits module defines should_apply_lm_head_quant_method twice; _compute_lm_head
    looks the name up at call time, and so does the gate."""
    from sglang.srt.layers import logits_processor

    compute = inspect.unwrap(LogitsProcessor._compute_lm_head)
    rule = compute.__globals__["should_apply_lm_head_quant_method"]
    assert rule is logits_processor.should_apply_lm_head_quant_method
    assert rule.__code__.co_firstlineno > 1000, "the later of the two definitions"
    assert shared_exchange.sglang_logits is logits_processor


def test_a_head_sharded_over_another_group_keeps_the_gather(hooked, draft_head, caplog):
    head = draft_head()
    head.group.world_size = 4
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert any("2 shards, the TP group 4 ranks" in line for line in log_lines(caplog))


def test_an_all_reduce_on_nccl_inside_capture_keeps_the_gather(hooked, draft_head, caplog):
    head = draft_head()
    probes = []

    def nccl_route(group, probe):
        probes.append(tuple(probe.shape))
        return "pynccl (in place)", True

    hooked.setattr(shared_exchange, "all_reduce_route", nccl_route)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head, max_rows=32) is False
    assert probes == [(1, 2 * 1 * 4)], "probed with the exchange buffer's shape, one row first"
    assert any("would run on NCCL (pynccl (in place))" in line for line in log_lines(caplog))


def test_the_kill_switch_wins(hooked, draft_head, caplog):
    head = draft_head()
    hooked.setenv(DRAFT_ARGMAX_EXCHANGE.env, "0")
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert any("SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE=0" in line for line in log_lines(caplog))


def test_an_opt_in_check_that_raises_keeps_the_gather(hooked, draft_head, caplog):
    head = draft_head()

    def broken(group, probe):
        raise RuntimeError("no such communicator")

    hooked.setattr(shared_exchange, "all_reduce_route", broken)
    assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert not engaged(head.processor)


def test_without_a_tp_group_the_opt_in_keeps_the_gather(hooked, draft_head, caplog):
    head = draft_head()

    class NoGroup:
        @property
        def tp_group(self):
            raise RuntimeError("parallel name 'tp_group' has not been written")

    hooked.setattr(shared_exchange, "get_parallel", NoGroup)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert head.processor.enable_draft_argmax_exchange(head.lm_head) is False
    assert any("no TP group" in line for line in log_lines(caplog))


# --- the exchange per call: same tokens as the gather ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("logit_scale", [None, 0.5])
def test_exchange_on_and_off_pick_the_same_draft_decode_tokens(
    dtype, logit_scale, hooked, draft_head
):
    head = draft_head(dtype=dtype, logit_scale=logit_scale)
    states = hidden(dtype=dtype)
    off = head.forward(states)
    assert off.next_token_argmax_partials is None
    assert torch.equal(off.next_token_logits, head.gathered_logits(states))

    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    head.group.calls.clear()
    on = head.forward(states)
    assert head.group.calls == ["all_reduce"], "the exchange replaced the gather"
    assert on.next_token_argmax_partials is not None
    assert on.next_token_logits.shape == (ROWS, head.vocab_size)
    assert on.next_token_logits.stride() == (on.next_token_argmax_partials.stride(0), 0)

    picks = {}
    for name, output in (("off", off), ("on", on)):
        positions = torch.arange(ROWS, dtype=torch.int64) * 7
        draft_tokens = torch.full((ROWS, 3), -1, dtype=torch.int64)
        topk_p, topk_index = worker_site.draft_decode_pick(
            draft_topk1_postprocess, output.next_token_logits, positions, draft_tokens, 2
        )
        picks[name] = (topk_p, topk_index, positions, draft_tokens)
    for ours, sglang in zip(picks["on"], picks["off"]):
        assert ours.dtype == sglang.dtype and torch.equal(ours, sglang)


def test_draft_extend_with_selected_rows_exchanges_and_picks_like_torch_argmax(hooked, draft_head):
    head = draft_head()
    states = hidden(rows=12)
    select_index = torch.tensor([2, 5, 8, 11])
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    on = head.forward(states, "draft_extend_v2", select_index)
    assert on.next_token_argmax_partials is not None
    _, topk_index = draft_argmax_finalize(on.next_token_argmax_partials, nan_policy="propagate")
    expected = torch.argmax(head.gathered_logits(states[select_index]), dim=-1, keepdim=True)
    assert torch.equal(topk_index, expected)


@pytest.mark.parametrize(
    "mode, select, fields",
    [
        ("idle", False, {}),
        ("extend", False, {}),
        ("draft_extend_v2", False, {}),
        ("decode", False, {"extend_return_logprob": True}),
    ],
    ids=["idle", "prefill-draft-extend", "eager-draft-extend", "logprobs"],
)
def test_calls_that_need_logits_keep_the_gather(mode, select, fields, hooked, draft_head):
    head = draft_head()
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    states = hidden()
    head.group.calls.clear()
    head.group.hidden = states
    logits = head.processor._get_logits(states, head.lm_head, head.metadata(mode, **fields))
    assert head.group.calls == ["all_gather"]
    assert draft_exchange(head.processor).exchange_rows(logits) is None
    assert torch.equal(logits, head.gathered_logits(states))


def test_another_head_or_a_bias_keeps_the_gather(hooked, draft_head):
    head = draft_head()
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    other_lm_head = copy.deepcopy(head.lm_head)
    states = hidden()
    head.group.hidden = states
    head.group.calls.clear()
    head.processor._get_logits(states, other_lm_head, head.metadata("decode"))
    head.processor._get_logits(
        states, head.lm_head, head.metadata("decode"), torch.zeros(head.vocab_size)
    )
    assert "all_reduce" not in head.group.calls


def test_a_processor_that_did_not_opt_in_keeps_the_gather(hooked, draft_head):
    head = draft_head()
    output = head.forward(hidden())
    assert head.group.calls == ["all_gather"]
    assert output.next_token_argmax_partials is None


# --- the EAGLE v2 draft worker's opt-in ------------------------------------------------------------


@pytest.fixture
def draft_worker(hooked, draft_head):
    """``draft_worker(checkpoint=..., **fields)``: SGLang's ``EagleDraftWorker`` of a
    ``draft_head`` deployment (built without a model runner: its draft model owns the draft head,
    the target model its own), drafting greedily with 3 steps; ``fields`` are set on the worker.
    Returns the worker, the deployment and the target model."""
    hooked.setattr(
        worker_site, "get_spec", lambda: SimpleNamespace(speculative_use_rejection_sampling=False)
    )
    hooked.setattr(worker_site, "get_batch_sizes_to_capture", lambda runner: (CAPTURE_BS, None))

    def build(checkpoint="unquantized", **fields):
        head = draft_head(checkpoint=checkpoint)
        worker = head.worker
        worker.topk = 1
        worker.speculative_num_steps = 3
        for name, value in fields.items():
            setattr(worker, name, value)
        return worker, head, head.target

    return build


def draft_model(cls, processor, lm_head):
    """A real draft model class instance holding only its processor and head (no weights loaded)."""
    model = object.__new__(cls)
    torch.nn.Module.__init__(model)
    model.logits_processor, model.lm_head = processor, lm_head
    return model


def run_capture_hook(worker) -> bool:
    """What SGLang runs before capturing the draft graphs: the plugin's BEFORE hook (here with
    nothing to capture after it); whether the draft model's processor is engaged."""
    worker_site.opt_in_draft_model(worker)
    processor = getattr(worker.draft_runner.model, "logits_processor", None)
    return processor is not None and engaged(processor)


def test_a_greedy_cuda_draft_worker_opts_its_draft_model_in_and_not_the_target(draft_worker):
    worker, head, target = draft_worker()
    assert run_capture_hook(worker) is True
    assert engaged(head.processor)
    assert not engaged(target.logits_processor), "the target model never opts in"


@pytest.mark.parametrize(
    "setup, expected",
    [
        (lambda w, mp, plat: setattr(w, "topk", 2), "topk is 2"),
        (lambda w, mp, plat: setattr(w, "hot_token_id", torch.arange(4)), "hot-token map"),
        (
            lambda w, mp, plat: mp.setattr(
                worker_site,
                "get_spec",
                lambda: SimpleNamespace(speculative_use_rejection_sampling=True),
            ),
            "rejection sampling",
        ),
        (
            lambda w, mp, plat: mp.setattr(
                worker_site,
                "get_flags",
                lambda: SimpleNamespace(capture=SimpleNamespace(enable_torch_compile=True)),
            ),
            "torch.compile",
        ),
        (lambda w, mp, plat: plat(cuda=False, hip=False), "not a CUDA platform"),
        (lambda w, mp, plat: plat(cuda=False, hip=True), "the changes are CUDA-only"),
        (
            lambda w, mp, plat: mp.setattr(
                w.draft_runner,
                "model",
                SimpleNamespace(
                    logits_processor=w.draft_runner.model.logits_processor,
                    lm_head=w.draft_runner.model.lm_head,
                ),
            ),
            "is not one whose forward hands the processor's output on untouched",
        ),
        (
            lambda w, mp, plat: mp.setattr(
                w.draft_runner.model, "logits_processor", None, raising=False
            ),
            "has no LogitsProcessor",
        ),
        (lambda w, mp, plat: mp.setenv(DRAFT_ARGMAX_EXCHANGE.env, "false"), "=false"),
    ],
    ids=[
        "topk2",
        "hot-tokens",
        "rejection-sampling",
        "torch-compile",
        "cpu",
        "hip",
        "other-draft-model",
        "no-processor",
        "switch-off",
    ],
)
def test_a_draft_worker_that_cannot_use_partials_keeps_the_gather(
    setup, expected, draft_worker, hooked, set_platform, caplog
):
    worker, head, _ = draft_worker()
    setup(worker, hooked, set_platform)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert run_capture_hook(worker) is False
    assert not engaged(head.processor)
    assert any(expected in line for line in log_lines(caplog))


@pytest.mark.parametrize("probe", ["SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_ENABLE_NAN_LOGITS_CHECK"])
def test_sglang_logit_probes_keep_the_gather(probe, draft_worker, caplog):
    worker, head, _ = draft_worker()
    with getattr(envs, probe).override(True):
        with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
            assert run_capture_hook(worker) is False
    assert any(probe in line for line in log_lines(caplog))


# --- the draft-extend pick after the replay --------------------------------------------------------


WIDTH = 4  # the draft-extend runner's captured tokens per request (speculative_num_draft_tokens)


def draft_extend_runner(worker, head, capture_bs):
    """SGLang's ``EAGLEDraftExtendCudaGraphRunner`` for ``worker``, built without a model runner:
    its input buffers as its constructor lays them out (at ``capture_bs``, ``WIDTH`` tokens a
    request), no attention metadata to prepare; its graph replay is the draft model's forward at
    the captured batch size: the processor's forward on the buffers' hidden states at the buffers'
    ``select_index``, those rows' hidden states passed through (the draft layers are left out)."""
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (
        EAGLEDraftExtendCudaGraphRunner,
        EagleDraftExtendInputBuffers,
    )

    runner = object.__new__(EAGLEDraftExtendCudaGraphRunner)
    max_bs = max(capture_bs)
    tokens = max_bs * WIDTH

    def full(size, value, dtype=torch.int64):
        return torch.full((size,), value, dtype=dtype)

    runner.buffers = EagleDraftExtendInputBuffers(
        input_ids=full(tokens, 0),
        req_pool_indices=full(max_bs, 0),
        mamba_track_indices=None,
        out_cache_loc=full(tokens, 1),
        positions=full(tokens, 0),
        mrope_positions=torch.zeros(3, tokens, dtype=torch.int64),
        hidden_states=torch.zeros(tokens, 64, dtype=torch.bfloat16),
        seq_lens=full(max_bs, 1),
        seq_lens_cpu=full(max_bs, 1),
        extend_seq_lens=full(max_bs, WIDTH, torch.int32),
        num_correct_drafts=full(max_bs, WIDTH, torch.int32),
        num_accept_tokens=full(max_bs, WIDTH, torch.int32),
        select_index=torch.arange(max_bs) * WIDTH + WIDTH - 1,
        next_token_logits_buffer=None,
        global_num_tokens_gpu=None,
        global_num_tokens_for_logprob_gpu=None,
    )
    runner.eagle_worker, runner.model_runner = worker, SimpleNamespace(
        model_config=SimpleNamespace(model_is_mrope=False), device_timer=None
    )
    runner.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    runner.capture_bs, runner.max_bs, runner.captured_req_width = capture_bs, max_bs, WIDTH
    runner.seq_len_fill_value, runner.extend_seq_lens_cpu = 1, [WIDTH] * max_bs
    runner.require_mlp_tp_gather = runner.require_gathered_buffer = False
    runner.require_mlp_sync = runner.disable_padding = False
    runner.deepep_adapter = SimpleNamespace(replay=lambda: None)
    runner.draft_extend_attn_backend = SimpleNamespace(
        init_forward_metadata_out_graph=lambda forward_batch: None,
        shared_read_ends=lambda mode: SharedReadEnds.UNKNOWN,
    )

    def replay_graph(shape_key, forward_batch):
        bs = shape_key.size
        tokens, select = (
            runner.buffers.hidden_states[: bs * WIDTH],
            runner.buffers.select_index[:bs],
        )
        output = head.forward(tokens, "draft_extend_v2", select)
        output.hidden_states = tokens[select]  # the last hidden states (CaptureHiddenMode.LAST)
        return output

    runner._replay_graph = replay_graph
    return runner


def test_sglangs_draft_extend_for_decode_takes_the_pick_from_the_replays_partials(
    draft_worker, hooked
):
    """SGLang's own ``EagleDraftWorker._draft_extend_for_decode`` and
    ``EAGLEDraftExtendCudaGraphRunner.execute`` (with the plugin's hooks), 3 requests padded to the
    captured batch size 4; SGLang's batch preparation returns the draft-extend batch."""
    from contextlib import nullcontext

    from sglang.srt.speculative import eagle_worker_v2

    worker, head, _ = draft_worker()
    assert run_capture_hook(worker)
    raw_bs, accept_lens = 3, torch.tensor([2, 4, 1])
    states = hidden(rows=raw_bs * WIDTH, seed=3)
    select_index = torch.arange(raw_bs) * WIDTH + accept_lens - 1
    forward_batch = SimpleNamespace(
        batch_size=raw_bs,
        input_ids=torch.zeros(raw_bs * WIDTH, dtype=torch.int64),
        seq_lens=torch.full((raw_bs,), 9),
        seq_lens_cpu=None,
        seq_lens_sum=None,
        out_cache_loc=torch.arange(raw_bs * WIDTH),
        out_cache_loc_virtual=None,
        positions=torch.arange(raw_bs * WIDTH),
        req_pool_indices=torch.arange(1, raw_bs + 1),
        extend_seq_lens=None,
        extend_seq_lens_cpu=None,
        mamba_track_indices=None,
        kv_loc_plan=None,
        kv_loc_cols=None,
        spec_info=SimpleNamespace(
            num_tokens_per_req=WIDTH,
            num_correct_drafts=accept_lens.int() - 1,
            num_accept_tokens=accept_lens.int(),
            hidden_states=states,
        ),
    )
    prepared = []

    def prepare_for_draft_extend(draft_extend_input, batch, *args, **kwargs):
        prepared.append(draft_extend_input)
        return forward_batch

    hooked.setattr(eagle_worker_v2, "prepare_for_draft_extend", prepare_for_draft_extend)
    worker.speculative_num_draft_tokens, worker.device = WIDTH, "cpu"
    worker.plan_stream, worker.plan_stream_ctx = None, nullcontext()
    worker.draft_runner.canary_manager = None
    worker.seed_dsa_topk_from_draft_extend = False
    worker.cuda_graph_runner_for_draft_extend = draft_extend_runner(worker, head, CAPTURE_BS)
    batch_result = SimpleNamespace(
        prepared_draft_extend_inputs=(accept_lens - 1, select_index, torch.zeros(raw_bs)),
        logits_output=SimpleNamespace(hidden_states=states),
        accept_lens=accept_lens,
        next_draft_input=SimpleNamespace(),
    )
    worker._draft_extend_for_decode(SimpleNamespace(), batch_result)

    assert len(prepared) == 1
    expected = torch.argmax(head.gathered_logits(states[select_index]), dim=-1, keepdim=True)
    next_draft_input = batch_result.next_draft_input
    assert torch.equal(next_draft_input.topk_index, expected)
    assert torch.equal(next_draft_input.topk_p, torch.ones(raw_bs, 1))
    assert torch.equal(next_draft_input.hidden_states, states[select_index])


def test_a_draft_extend_without_partials_keeps_sglangs_pick(draft_worker):
    worker, head, _ = draft_worker(topk=2)
    assert run_capture_hook(worker) is False
    sentinel = SimpleNamespace(topk_p="p", topk_index="i")
    batch_result = SimpleNamespace(next_draft_input=sentinel)
    calls = []
    worker_site.draft_extend_for_decode(
        lambda *args: calls.append(args), worker, None, batch_result
    )
    assert len(calls) == 1 and (sentinel.topk_p, sentinel.topk_index) == ("p", "i")


def test_real_logits_reach_sglang_postprocess_unchanged(hooked):
    logits = torch.randn(3, 50)
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "sglang"

    positions = torch.zeros(3, dtype=torch.int64)
    assert worker_site.draft_decode_pick(original, logits, positions, None, 0) == "sglang"
    assert calls[0][0][0] is logits


def test_sglang_postprocess_refuses_a_stand_in_instead_of_reading_it(hooked, draft_head):
    head = draft_head()
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    draft = draft_exchange(head.processor)
    exchange = torch.zeros(2, 8)
    stand_in = draft.stand_in(exchange)
    assert draft.exchange_rows(stand_in[:1]).shape == (1, 8)
    with pytest.raises(AssertionError):
        inspect.unwrap(draft_topk1_postprocess)(stand_in, torch.zeros(2, dtype=torch.int64))


def test_logits_processor_class_gets_only_the_documented_additions(hooked):
    assert callable(LogitsProcessor.enable_draft_argmax_exchange)
    assert LogitsProcessorOutput.next_token_argmax_partials is None


def test_glm5_nextn_drafts_opt_in_too(draft_worker):
    worker, head, _ = draft_worker()
    worker.draft_runner.model = draft_model(GlmMoeDsaForCausalLMNextN, head.processor, head.lm_head)
    assert run_capture_hook(worker) is True


def test_an_engaged_processor_stays_engaged_when_sglang_captures_again(draft_worker, hooked):
    worker, head, _ = draft_worker()
    assert run_capture_hook(worker) is True
    hooked.setattr(shared_exchange, "all_reduce_route", lambda group, probe: ("pynccl", True))
    assert run_capture_hook(worker) is True, "graphs captured with the exchange are still replayed"


def test_engaging_runs_the_logits_gather_once_so_its_buffer_is_built_at_start_up(
    hooked, draft_head
):
    head = draft_head()
    calls = []
    head.processor._logits_gatherer = lambda x: calls.append((tuple(x.shape), x.dtype)) or x
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    assert calls == [((1, head.lm_head.num_embeddings_per_partition), torch.bfloat16)]

    kept = draft_head(final_logit_softcapping=30.0)
    calls.clear()
    kept.processor._logits_gatherer = lambda x: calls.append(x) or x
    assert not kept.processor.enable_draft_argmax_exchange(kept.lm_head)
    assert calls == [], "a processor that keeps the gather builds it lazily, as SGLang does"


def test_the_exchange_and_its_pick_work_under_inference_mode(hooked, draft_head):
    """SGLang's scheduler may run under torch.inference_mode (SGLANG_ENABLE_TORCH_INFERENCE_MODE),
    where views record no base: the stand-in must still lead to its exchange."""
    head = draft_head()
    states = hidden()
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    with torch.inference_mode():
        on = head.forward(states)
        assert on.next_token_argmax_partials is not None
        positions = torch.zeros(ROWS, dtype=torch.int64)
        _, ours = worker_site.draft_decode_pick(
            draft_topk1_postprocess, on.next_token_logits, positions
        )
    gathered = head.gathered_logits(states)
    _, sglang = inspect.unwrap(draft_topk1_postprocess)(
        gathered, torch.zeros(ROWS, dtype=torch.int64)
    )
    assert torch.equal(ours, sglang)


def test_a_row_slice_of_a_stand_in_leads_to_the_same_rows_of_the_exchange(hooked, draft_head):
    head = draft_head()
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    draft, vocab = draft_exchange(head.processor), head.vocab_size
    exchange = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    stand_in = draft.stand_in(exchange)
    assert torch.equal(draft.exchange_rows(stand_in[2:5]), exchange[2:5])
    assert draft.exchange_rows(torch.zeros(6, vocab)) is None
    assert draft.exchange_rows(torch.zeros(1, 1).expand(6, vocab)) is None


def test_a_hook_sglang_failed_to_apply_keeps_the_gather(draft_worker, hooked, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    worker, head, _ = draft_worker()
    target = "sglang.kernels.ops.speculative.topk1.draft_topk1_postprocess"
    hooked.setattr(HookRegistry, "_patched", HookRegistry._patched - {target})
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert run_capture_hook(worker) is False
    assert any(f"did not apply the plugin's hooks on {target}" in m for m in log_lines(caplog))


# --- compiled before the first request ------------------------------------------------------------


def record_warm_ups(monkeypatch) -> list[dict]:
    """Every ``warm_up`` call of the opt-in, recorded, then run for real."""
    calls = []
    real = shared_exchange.warm_up

    def recorder(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(shared_exchange, "warm_up", recorder)
    return calls


def test_the_opt_in_compiles_every_kernel_variant_for_the_captured_batch_sizes(
    draft_worker, hooked
):
    calls = record_warm_ups(hooked)
    worker, head, _ = draft_worker()
    head.group.calls.clear()
    assert run_capture_hook(worker) is True
    [call] = calls
    assert call == dict(
        rows=CAPTURE_BS,
        shard_width=head.lm_head.num_embeddings_per_partition,
        tp_size=2,
        vocab_size=head.vocab_size,
        dtypes=(torch.bfloat16,),
        device=head.lm_head.weight.device,
        draft_steps=worker.speculative_num_steps,
    )
    assert "all_reduce" not in head.group.calls, "the warm-up runs no collective"


def test_sglangs_draft_capture_runs_after_the_opt_in_and_its_warm_up(draft_worker, hooked):
    """SGLang's own ``EagleDraftWorker._capture_cuda_graphs`` (as its HookRegistry patched it), on
    a CUDA-like worker: the draft-decode graph runner it builds captures the graphs in its
    constructor, so the runner records what had happened when SGLang built it: the processor
    engaged and the kernels compiled for the captured batch sizes."""
    from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.speculative import eagle_worker_v2

    calls = record_warm_ups(hooked)
    worker, head, _ = draft_worker()
    captures = []

    class DraftDecodeCapture:
        def __init__(self, eagle_worker):
            assert eagle_worker is worker
            captures.append((engaged(head.processor), [call["rows"] for call in calls]))

    hooked.setattr(eagle_worker_v2, "_is_cpu", False)
    hooked.setattr(eagle_worker_v2, "EAGLEDraftCudaGraphRunner", DraftDecodeCapture)
    hooked.setattr(eagle_worker_v2, "get_available_gpu_memory", lambda device, gpu_id: 0.0)
    hooked.setattr(eagle_worker_v2, "get_batch_sizes_to_capture", lambda runner: (CAPTURE_BS, None))
    worker.target_worker.device = "cuda"
    worker.device, worker.gpu_id = "cuda", 0
    worker._specialized_graph_memory_usage, worker._specialized_graph_time_usage = {}, {}
    worker.draft_extend_attn_backend = None
    with get_exec().graph.override(cuda_graph_config=default_cuda_graph_config()):
        worker._capture_cuda_graphs()
    assert captures == [(True, [CAPTURE_BS])], "captured after the opt-in and its warm-up"
    assert isinstance(worker.cuda_graph_runner, DraftDecodeCapture)


def test_a_processor_opted_in_directly_warms_up_for_one_row_and_its_max_rows(hooked, draft_head):
    calls = record_warm_ups(hooked)
    head = draft_head(dtype=torch.float32)
    assert head.processor.enable_draft_argmax_exchange(head.lm_head, max_rows=16)
    [call] = calls
    assert call["rows"] == [1, 16] and call["dtypes"] == (torch.float32,)
    assert call["draft_steps"] is None


def test_an_fp32_lm_head_output_warms_up_fp32_logits_too(hooked, draft_head):
    calls = record_warm_ups(hooked)
    head = draft_head()
    head.processor.use_fp32_lm_head_output = True
    assert head.processor.enable_draft_argmax_exchange(head.lm_head)
    assert calls[0]["dtypes"] == (torch.bfloat16, torch.float32)


def test_a_warm_up_that_fails_keeps_the_gather(draft_worker, hooked, caplog):
    def broken(**kwargs):
        raise RuntimeError("ptxas died")

    hooked.setattr(shared_exchange, "warm_up", broken)
    worker, head, _ = draft_worker()
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert run_capture_hook(worker) is False
    assert not engaged(head.processor)
    [line] = log_lines(caplog)
    assert "compiling the exchange kernels ahead failed (RuntimeError: ptxas died)" in line


# --- what decided it: one INFO line per draft worker ----------------------------------------------


@pytest.mark.parametrize(
    "setup, engages, expected",
    [
        (
            dict(checkpoint="modelopt_fp4"),
            True,
            "sglang_dsa_mtp: draft_argmax_exchange on: greedy draft exchanges argmax partials "
            "(draft model GlmMoeDsaForCausalLMNextN, topk 1, tp size 2, LM-head quant method "
            "ModelOptFp4LinearMethod (not applied by SGLang), head dtype bfloat16, all-reduce CPU "
            "shared memory or torch.distributed, kernel variants compiled ahead 4)",
        ),
        (
            dict(topk=2),
            False,
            "sglang_dsa_mtp: draft_argmax_exchange off: greedy draft keeps the logits gather: "
            "--speculative-eagle-topk is 2: drafts need probabilities (draft model "
            "DeepseekV3ForCausalLMNextN, topk 2, tp size 2)",
        ),
        (
            dict(checkpoint="modelopt_fp8_quantized_lm_head"),
            False,
            "sglang_dsa_mtp: draft_argmax_exchange off: greedy draft keeps the logits gather: "
            "SGLang applies the LM head's quant method ModelOptFp8LinearMethod (a quantized "
            "LM-head kernel) (draft model GlmMoeDsaForCausalLMNextN, topk 1, tp size 2, LM-head "
            "quant method ModelOptFp8LinearMethod (applied by SGLang), head dtype float8_e4m3fn)",
        ),
    ],
    ids=["engaged-nvfp4-head", "stopped-by-topk-2", "stopped-by-a-quantized-lm-head"],
)
def test_a_draft_worker_logs_one_line_with_the_facts_that_decided(
    setup, engages, expected, draft_worker, caplog
):
    worker, _, _ = draft_worker(**setup)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        assert run_capture_hook(worker) is engages
    assert log_lines(caplog) == [expected]


def test_the_decision_is_logged_once_per_process(draft_worker, caplog):
    worker, _, _ = draft_worker(topk=2)
    with caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        run_capture_hook(worker)
        run_capture_hook(worker)
    assert len(log_lines(caplog)) == 1
