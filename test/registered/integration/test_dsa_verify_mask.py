"""The DSA target's QLEN_ONLY, not-read verify mask, on SGLang's real backends and verify path.

The target is built by SGLang's attention registry in a published EAGLE launch and gets its graph
state from SGLang's ``init_cuda_graph_state`` (``support.dsa_backends``). The draft
tree is SGLang's own topk=1 chain (``_rebuild_topk1_chain_buffers``). SGLang's CUDA tree kernels are
JIT-compiled CUDA; here the tree builder, the greedy verify and the cache-location kernels run as
SGLang's Triton implementations (its XPU path), through Triton's interpreter.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from support.sglang_import import require_sglang

require_sglang()

import sglang.kernels.ops.speculative.cache_locs as cache_locs
import sglang.kernels.ops.speculative.spec_tree as spec_tree
from sglang.kernels.ops.speculative.eagle import build_chain_tree
from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask, tree_mask_numel
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase
from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode
from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input

from sglang_dsa_mtp import hooks
from sglang_dsa_mtp.switches import LIVE_WIDTH
from support import dsa_backends as kit

CONTEXT = 1000
MAX_BS = 4


@pytest.fixture
def server(hooked):
    kit.cuda_stand_ins(hooked)
    # SGLang's Triton tree builder, greedy verify and cache-location kernels (its XPU path).
    hooked.setattr(spec_tree, "_is_xpu", True)
    hooked.setattr(cache_locs, "_is_xpu", True)
    return hooked


def target(runner=None, **runner_args):
    tokens = get_spec().speculative_num_draft_tokens or 0
    backend = kit.target_backend(runner or kit.model_runner(context_len=CONTEXT, **runner_args))
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * max(tokens, 1))
    return backend


@pytest.mark.quick
def test_the_live_width_switch_gives_the_dsa_backend_a_verify_mask_property():
    [row] = list(hooks.attributes_of(LIVE_WIDTH))
    assert row.target.endswith("DeepseekSparseAttnBackend.verify_mask")
    assert row.shadows.endswith("base_attn_backend.AttentionBackend")


@pytest.mark.parametrize("launch", ["4/1/5", "5/1/6"])
def test_the_spec_target_gets_the_mask_sglangs_flashmla_backend_builds(server, launch):
    with kit.serving(launch):
        backend = target()
        tokens = get_spec().speculative_num_draft_tokens
        flashmla = maybe_create_verify_mask(
            is_draft_runner=False,
            skip_prefill=False,
            max_bs=MAX_BS,
            max_context_len=CONTEXT,
            num_draft_tokens=tokens,
            device="cpu",
            is_read=False,
        )
    mask = backend.verify_mask
    assert (mask.mode, mask.max_bs, mask.is_read) == (TreeMaskMode.QLEN_ONLY, MAX_BS, False)
    assert (mask.mode, mask.max_bs, mask.is_read) == (flashmla.mode, flashmla.max_bs, False)
    assert mask.buffer.shape == flashmla.buffer.shape == (MAX_BS * tokens * tokens,)


def test_draft_backends_have_no_mask(server):
    with kit.serving():
        extend, multi = kit.draft_backends(kit.model_runner(context_len=CONTEXT, is_draft=True))
        extend.init_cuda_graph_state(MAX_BS, MAX_BS * 5)
        multi.init_cuda_graph_state(MAX_BS, MAX_BS)
    assert extend.verify_mask is None
    assert all(step.verify_mask is None for step in multi.attn_backends)


@pytest.mark.parametrize(
    "case,why",
    [
        (dict(env="0"), "SGLANG_DSA_LIVE_WIDTH=0"),
        (dict(args=dict(enable_watermark=True)), "watermark"),
        (dict(args=dict(enable_two_batch_overlap=True)), "two-batch overlap"),
        (dict(launch=None), "no speculative decoding"),
        (dict(launch=(3, 2, 6)), "--speculative-eagle-topk is not 1"),
        (dict(platform=False), "not a CUDA platform"),
    ],
    ids=["switch-off", "watermark", "two-batch-overlap", "no-spec", "tree-draft", "not-cuda"],
)
def test_where_a_reader_is_active_the_target_keeps_sglangs_full_mask(
    server, set_platform, caplog, case, why
):
    if "env" in case:
        server.setenv(LIVE_WIDTH.env, case["env"])
    if "platform" in case:
        set_platform(cuda=False, hip=False)
    with (
        kit.serving(case.get("launch", "4/1/5"), **case.get("args", {})),
        caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"),
    ):
        backend = target()
    assert backend.verify_mask is None
    assert why in caplog.text


def test_a_live_width_hook_sglang_left_unapplied_keeps_sglangs_full_mask(server, unapplied, caplog):
    why = unapplied("DeepseekSparseAttnBackend._init_kpool_metadata_capture")
    with kit.serving(), caplog.at_level(logging.INFO, logger="sglang_dsa_mtp"):
        backend = target()
    assert backend.verify_mask is None
    assert why in caplog.text


def test_an_error_building_the_mask_keeps_sglangs_path(server, caplog):
    import sglang_dsa_mtp.integration.dsa_verify_mask as verify_mask

    def broken(**kwargs):
        raise RuntimeError("broken for the test")

    server.setattr(verify_mask, "maybe_create_verify_mask", broken)
    with kit.serving(), caplog.at_level(logging.ERROR, logger="sglang_dsa_mtp"):
        backend = target()
    assert backend.verify_mask is None
    assert "keeps SGLang's FULL_MASK path: RuntimeError: broken for the test" in caplog.text


# --- what the verify path does with it --------------------------------------------------------------


def verify_inputs(backend, seq_lens, req_pool_indices, seed=0):
    """SGLang's ``build_eagle_verify_input`` for a topk=1 chain draft of these requests."""
    spec = get_spec()
    steps, tokens = spec.speculative_num_steps, spec.speculative_num_draft_tokens
    bs = len(seq_lens)
    worker = SimpleNamespace(
        topk=1,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=tokens,
        device="cpu",
        server_args=None,
    )
    EagleDraftWorkerBase._rebuild_topk1_chain_buffers(worker)
    generator = torch.Generator().manual_seed(seed)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=None,  # DSA: needs_cpu_seq_lens = False
        req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64),
        req_to_token_pool=SimpleNamespace(req_to_token=backend.req_to_token),
        multimodal_inputs=[None] * bs,
    )
    draft_input = SimpleNamespace(bonus_tokens=torch.randint(0, 1000, (bs,), generator=generator))
    draft_tokens = torch.randint(0, 1000, (bs, steps), generator=generator)
    target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            attn_backend=backend, model_config=SimpleNamespace(model_is_mrope=False)
        )
    )
    verify_input = build_eagle_verify_input(
        batch,
        draft_input,
        worker._topk1_parents_prealloc[:bs],
        worker._topk1_score_indices_prealloc[:bs],
        draft_tokens,
        None,
        target_worker=target_worker,
        topk=1,
        num_steps=steps,
        num_draft_tokens=tokens,
        tree_mask_mode=default_tree_mask_mode(),
        device="cpu",
    )
    return batch, draft_input, draft_tokens, verify_input


def accept(verify_input, bs, target_predict):
    """SGLang's greedy tree verify of ``verify_input`` against the target's picks."""
    tokens = verify_input.draft_token_num
    predict = torch.zeros(bs * tokens, dtype=torch.int32)
    accept_index = torch.full((bs, verify_input.spec_steps + 1), -1, dtype=torch.int32)
    accept_len = torch.empty(bs, dtype=torch.int32)
    return spec_tree.verify_tree_greedy_func(
        predict,
        accept_index,
        accept_len,
        verify_input.draft_token.reshape(bs, tokens),
        verify_input.retrieve_index,
        verify_input.retrieve_next_token,
        verify_input.retrieve_next_sibling,
        target_predict,
        topk=1,
    )


ROUNDS = (([129, 0, 700], [5, 2, 7]), ([1], [3]), ([63, 64, 65, 994], [1, 3, 0, 6]))
FIELDS = (
    "draft_token",
    "positions",
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
)


@pytest.mark.quick
def test_the_verify_round_allocates_no_full_mask_and_verifies_the_same_tokens(server):
    """SGLang's verify input with and without the mask (on the CPU SGLang takes the tree builder in
    both: its chain-tree kernel needs CUDA tensors, see the next test)."""
    with kit.serving():
        server.setenv(LIVE_WIDTH.env, "1")
        ours_backend = target()
        server.setenv(LIVE_WIDTH.env, "0")
        stock_backend = target(kit.model_runner(context_len=CONTEXT))
        tokens = get_spec().speculative_num_draft_tokens
        for seed, (lengths, requests) in enumerate(ROUNDS):
            bs = len(lengths)
            *_, ours = verify_inputs(ours_backend, lengths, requests, seed)
            *_, stock = verify_inputs(stock_backend, lengths, requests, seed)
            assert ours.custom_mask is ours_backend.verify_mask.buffer, "written in place"
            full = tree_mask_numel(TreeMaskMode.FULL_MASK, bs, tokens, CONTEXT)
            assert stock.custom_mask.numel() == full, "stock sizes it bs x context x draft tokens"
            for field in FIELDS:
                assert torch.equal(getattr(ours, field), getattr(stock, field)), field
            predict = torch.randint(
                0, 1000, (bs, tokens), generator=torch.Generator().manual_seed(seed)
            )
            predict[:, :2] = ours.draft_token.reshape(bs, tokens)[:, 1:3]  # accept some drafts
            for a, b in zip(accept(ours, bs, predict), accept(stock, bs, predict)):
                assert torch.equal(a, b)


def test_the_chain_tree_path_cuda_takes_gives_the_stock_verify_inputs_and_cache_locations(server):
    """On CUDA, with the QLEN_ONLY mask and topk 1, SGLang's verify input comes from its fused
    ``build_chain_tree`` (called as ``build_eagle_verify_input`` calls it), which also prepares the
    verify ``out_cache_loc`` that ``eagle_prepare_for_verify`` otherwise assigns. Both against the
    stock path: the FULL_MASK tree build and ``assign_extend_cache_locs_uniform_func``."""
    with kit.serving():
        server.setenv(LIVE_WIDTH.env, "0")
        stock_backend = target()
        torch.manual_seed(0)
        stock_backend.req_to_token.copy_(torch.randint_like(stock_backend.req_to_token, 1 << 30))
        tokens = get_spec().speculative_num_draft_tokens
        for seed, (lengths, requests) in enumerate(ROUNDS):
            bs = len(lengths)
            batch, draft_input, draft_tokens, stock = verify_inputs(
                stock_backend, lengths, requests, seed
            )
            buffer = torch.zeros(MAX_BS * tokens * tokens, dtype=torch.bool)
            mask, *chain, out_cache_loc, mrope = build_chain_tree(
                draft_input.bonus_tokens,
                draft_tokens,
                batch.seq_lens,
                buffer,
                req_pool_indices=batch.req_pool_indices,
                req_to_token=stock_backend.req_to_token,
                with_mrope=False,
            )
            for field, value in zip(
                ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"),
                chain[:4],
            ):
                assert torch.equal(value, getattr(stock, field)), field
            assert torch.equal(chain[4], stock.draft_token)
            assigned = cache_locs.assign_extend_cache_locs_uniform_func(
                req_pool_indices=batch.req_pool_indices,
                req_to_token=stock_backend.req_to_token,
                start_offset=batch.seq_lens,
                batch_size=bs,
                draft_token_num=tokens,
                device="cpu",
            )
            assert out_cache_loc.dtype == assigned.dtype and torch.equal(out_cache_loc, assigned)
            assert mrope is None
            # The tree cells of both layouts agree (the prefix columns of FULL_MASK are all True).
            stock_tree = torch.stack(
                [
                    stock.custom_mask[offset : offset + tokens * (n + tokens)].view(
                        tokens, n + tokens
                    )[:, n:]
                    for n, offset in zip(lengths, _full_mask_offsets(lengths, tokens))
                ]
            )
            assert torch.equal(mask[: bs * tokens * tokens].view(bs, tokens, tokens), stock_tree)


def _full_mask_offsets(lengths, tokens):
    offsets, offset = [], 0
    for n in lengths:
        offsets.append(offset)
        offset += tokens * (n + tokens)
    return offsets
