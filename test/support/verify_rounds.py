"""One EAGLE verify round through SGLang 0.5.23's own verify code, for the target-verify argmax
exchange's tests.

* :func:`verify_kernels_in_triton`: SGLang's tree builder, greedy tree verify and top-k / top-p
  renormalization through its Triton implementations, where its CUDA JIT kernels cannot run (the
  CPU) or are not wanted (a GPU test without nvcc); both arms of a comparison take the same kernels.
* :func:`verify_batch`: a decode batch of requests, each with SGLang's ``SamplingParams`` of one of
  :data:`REQUESTS` (greedy, sampled, top-k, logit bias, penalties), and its ``SamplingBatchInfo`` built by
  SGLang's ``from_schedule_batch`` (penalties accumulated as the EAGLE worker's
  ``eagle_prepare_for_decode`` does), on SGLang's ``ScheduleBatch`` class holding the fields the
  verify reads.
* :func:`chain_verify_input`: SGLang's ``build_eagle_verify_input`` for a topk=1 chain draft of the
  batch (SGLang's chain buffers, sized by the published launch; a target without a verify mask),
  draft tokens copied from given target picks in the first positions so that drafts get accepted.
* :func:`sglang_verify`: SGLang's ``eagle_sample`` (with the plugin's hooks where SGLang applied
  them) on a ``LogitsProcessorOutput``: predict, accept lengths, accept index, the committed tokens
  and the logits it read.

SGLang is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Optional

import torch

# SGLang SamplingParams of each request kind; "sampled" and "top_k" sample, the others are greedy
# (top_k 1). SGLang renormalizes top-k probabilities with a CUDA/HIP kernel: a batch of "sampled"
# requests alone (no top-k, no top-p) is the sampled verify the CPU can run.
REQUESTS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=20),
    "logit_bias": dict(temperature=0.0, logit_bias={"7": 2.5, "600": -1.0}),
    "penalties": dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25),
}


@contextlib.contextmanager
def verify_kernels_in_triton():
    """SGLang's verify kernels as its Triton implementations, where its CUDA JIT kernels cannot run
    (the CPU) or are not wanted (a GPU test without nvcc): ``spec_tree``'s tree builder and greedy
    verify as its XPU path runs them, and the sampled verify's top-k / top-p renormalization as its
    HIP path binds them (``renorm_triton``). Both arms of a comparison take the same kernels."""
    from sglang.kernels.ops.sampling import renorm_triton
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative import eagle_utils

    patched = {
        spec_tree: dict(_is_cuda=False, _is_hip=False, _is_xpu=True),
        eagle_utils: dict(
            top_k_renorm_prob=renorm_triton.top_k_renorm_probs_triton,
            top_p_renorm_prob=renorm_triton.top_p_renorm_probs_triton,
        ),
    }
    saved = {
        module: {name: getattr(module, name) for name in names} for module, names in patched.items()
    }
    for module, values in patched.items():
        for name, value in values.items():
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, values in saved.items():
            for name, value in values.items():
                setattr(module, name, value)


def _request(kind: str, vocab_size: int):
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**REQUESTS[kind])
    params.normalize(None)
    params.verify(vocab_size)
    return SimpleNamespace(
        sampling_params=params,
        custom_logit_processor=None,
        return_sampling_mask=False,
        sampling_logprobs_mode=None,
    )


def verify_batch(
    kinds: list[str],
    vocab_size: int,
    *,
    seq_lens: Optional[list[int]] = None,
    return_logprob: bool = False,
    device="cpu",
):
    """A decode ``ScheduleBatch`` (SGLang's class, the fields the verify reads) of one request per
    entry of ``kinds`` (keys of :data:`REQUESTS`), with SGLang's ``SamplingBatchInfo``."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    bs = len(kinds)
    batch = object.__new__(ScheduleBatch)
    batch.reqs = [_request(kind, vocab_size) for kind in kinds]
    batch.device = device
    batch.forward_mode = ForwardMode.DECODE
    lengths = seq_lens if seq_lens is not None else [40 + 13 * i for i in range(bs)]
    batch.seq_lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    batch.seq_lens_sum = None  # DSA: needs_cpu_seq_lens = False
    batch.req_pool_indices = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    batch.multimodal_inputs = [None] * bs
    batch.return_logprob = return_logprob
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size)
    batch.sampling_info.update_penalties()
    return batch


def chain_verify_input(batch, *, steps: int, predict_hint: torch.Tensor, seed: int = 0):
    """SGLang's ``build_eagle_verify_input`` of a topk=1 chain draft of ``steps`` tokens per request
    for ``batch`` (a target without a verify mask: SGLang's FULL_MASK tree builder). The draft
    tokens are random below the vocab, except that request i's first ``i % (steps + 1)`` drafts are
    ``predict_hint`` (``[bs, steps + 1]`` target picks) shifted by one: those drafts are accepted
    where the target picks them."""
    from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase
    from sglang.srt.speculative.eagle_utils import default_tree_mask_mode
    from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input

    bs, device = batch.seq_lens.shape[0], batch.seq_lens.device
    tokens = steps + 1
    vocab_size = batch.sampling_info.vocab_size
    chain = SimpleNamespace(
        topk=1,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=tokens,
        device=device,
        server_args=None,
    )
    EagleDraftWorkerBase._rebuild_topk1_chain_buffers(chain)
    if chain._topk1_parents_prealloc.shape[0] < bs:
        raise ValueError(
            f"the published launch sizes SGLang's chain buffers for "
            f"{chain._topk1_parents_prealloc.shape[0]} requests (max running requests), "
            f"the batch has {bs}"
        )
    generator = torch.Generator().manual_seed(seed)
    bonus = torch.randint(0, vocab_size, (bs,), generator=generator).to(device)
    drafts = torch.randint(0, vocab_size, (bs, steps), generator=generator).to(device)
    for i in range(bs):
        accepted = i % tokens
        drafts[i, :accepted] = predict_hint[i, :accepted].to(device)
    max_context = int(batch.seq_lens.max()) + tokens
    target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            attn_backend=SimpleNamespace(verify_mask=None, max_context_len=max_context),
            model_config=SimpleNamespace(model_is_mrope=False),
        )
    )
    return build_eagle_verify_input(
        batch,
        SimpleNamespace(bonus_tokens=bonus),
        chain._topk1_parents_prealloc[:bs],
        chain._topk1_score_indices_prealloc[:bs],
        drafts,
        None,
        target_worker=target_worker,
        topk=1,
        num_steps=steps,
        num_draft_tokens=tokens,
        tree_mask_mode=default_tree_mask_mode(),
        device=str(device),
    )


def sglang_verify(verify_input, batch, logits_output, *, grammar_mask=None, seed: int = 0) -> dict:
    """SGLang's ``eagle_sample`` of ``logits_output`` (torch's generators seeded with ``seed``
    first, for a sampled verify's coins): ``predict``, ``accept_lens``, ``accept_index``,
    ``committed`` (each request's accepted tokens, ``-1`` past its accept length) and ``logits``: a
    copy of ``next_token_logits`` after the verify (which applies penalties, bias and the grammar
    mask in place), None where it holds none."""
    from sglang.srt.speculative.eagle_utils import eagle_sample

    torch.manual_seed(seed)
    predict, accept_lens, accept_index = eagle_sample(
        verify_input, batch, logits_output, grammar_mask
    )
    safe = accept_index.clamp(min=0).long()
    committed = torch.where(accept_index >= 0, predict[safe], torch.full_like(predict[safe], -1))
    logits = logits_output.next_token_logits
    return dict(
        predict=predict,
        accept_lens=accept_lens,
        accept_index=accept_index,
        committed=committed,
        logits=None if logits is None or logits.is_meta else logits.clone(),
    )
