"""After the warm-up, replaying every captured batch size compiles nothing.

The plugin warms up, at capture, the exact kernel variant each replay-metadata call will launch
(``launch.warm_up``, called from ``integration/dsa_metadata_capture.py`` and
``integration/dsa_mtp_draft_metadata.py`` with the arguments SGLang's replay passes: checked on the
CPU against SGLang's real replay in ``test/registered/integration/test_dsa_metadata_capture.py``).
Here, on the GPU (Triton's interpreter compiles nothing), the compiled variants of our kernels are
dropped, captured batch sizes covering every size class our kernels compile for up to 64 are warmed
up on buffers laid out as SGLang allocates them (page 64, next_n 5, a 1M-token table), and then a
sweep of real calls (decode, target verify, draft extend, the MTP one launch into 1 to 4 step
backends; new lengths and slots, inputs at an odd address too) is counted with Triton's compile
hook: zero compiles. The same for a replay that falls back to SGLang's kernel (which specializes on
the batch size) after the capture-time warm-up of both (``Fallback.warm_up``).
"""

import pytest
import torch

from sglang_dsa_mtp.integration.fallback import Fallback
from sglang_dsa_mtp.kernels.ops.attention import dsa_draft_decode_metadata as draft
from sglang_dsa_mtp.kernels.ops.attention import dsa_metadata_bounded as bounded
from sglang_dsa_mtp.kernels.ops.launch import warm_up
from support.compiles import count_compiles, forget_compiled
from support.metadata_cases import CapturedBuffers, kernel_for, one_launch_kwargs
from support.reference import metadata_module

# Batch sizes from SGLang's default capture list: every power-of-two class our kernels specialize on
# (the request count, and the expanded rows of verify and draft extend) up to 64.
CAPTURED = [1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64]
OPS = ("decode", "verify", "draft_extend")
KERNELS = (
    bounded.bounded_decode_metadata_kernel,  # decode and the MTP one launch
    bounded._bounded_target_verify_metadata_kernel,
    bounded._bounded_draft_extend_metadata_kernel,
)


def new_inputs(bs, req_to_token, generator, *, odd_address):
    """Replay inputs as the graph runner passes them, or at an address 8 bytes off alignment."""
    pool, width = req_to_token.shape
    lengths = torch.randint(0, width - 8, (bs + 1,), generator=generator)
    slots = torch.randint(0, pool, (bs + 1,), generator=generator)
    offset = 1 if odd_address else 0
    lengths, slots = lengths.to(req_to_token.device), slots.to(req_to_token.device)
    return lengths[offset : offset + bs], slots[offset : offset + bs]


@pytest.mark.gpu
def test_no_compile_after_the_warm_up_of_every_captured_bs(req_to_token_1m):
    page_size = 64
    backends = {
        op: CapturedBuffers(req_to_token_1m, max_bs=64, next_n=5, page_size=page_size, topk=2048)
        for op in OPS
    }
    steps = [
        CapturedBuffers(req_to_token_1m, max_bs=64, next_n=1, page_size=page_size, topk=2048)
        for _ in range(4)
    ]
    forget_compiled(*KERNELS)
    with count_compiles() as warm_up_compiles:
        for bs in CAPTURED:
            for op, buffers in backends.items():
                warm_up(kernel_for(op, "bounded"), **buffers.replay_kwargs(op, bs))
            for n in range(1, 5):
                first = steps[0].replay_kwargs("decode", bs)
                kwargs = one_launch_kwargs(
                    steps[:n], bs, first["seq_lens"], first["req_pool_indices"]
                )
                warm_up(draft.fused_dsa_draft_decode_metadata_multi, **kwargs)
    assert warm_up_compiles.names, "the warm-up compiled nothing: the compile count is not working"

    gen = torch.Generator().manual_seed(page_size)
    with count_compiles() as replay_compiles:
        for bs in CAPTURED:
            for odd_address in (False, True, False):
                seq_lens, slots = new_inputs(bs, req_to_token_1m, gen, odd_address=odd_address)
                for op, buffers in backends.items():
                    kwargs = buffers.replay_kwargs(op, bs)
                    kwargs.update(seq_lens=seq_lens, req_pool_indices=slots)
                    kernel_for(op, "bounded")(**kwargs)
                for n in range(1, 5):
                    draft.fused_dsa_draft_decode_metadata_multi(
                        **one_launch_kwargs(steps[:n], bs, seq_lens, slots)
                    )
        torch.cuda.synchronize(req_to_token_1m.device)
    assert replay_compiles.names == [], replay_compiles.describe()
    print(
        f"warm-up compiled {len(warm_up_compiles.names)} variants for {len(CAPTURED)} batch sizes; "
        f"the replay sweep compiled {len(replay_compiles.names)}"
    )


@pytest.mark.gpu
def test_the_compile_count_sees_a_new_variant_and_nothing_on_a_second_call(req_to_token_1m):
    buffers = CapturedBuffers(req_to_token_1m, max_bs=4, next_n=5, page_size=64, topk=2048)
    forget_compiled(bounded.bounded_decode_metadata_kernel)
    kwargs = buffers.replay_kwargs("decode", 3)
    with count_compiles() as first:
        bounded.fused_dsa_decode_metadata_bounded(**kwargs)
    with count_compiles() as second:
        bounded.fused_dsa_decode_metadata_bounded(**kwargs)
    assert len(first.names) == 1 and second.names == [], (first.describe(), second.describe())


@pytest.mark.gpu
def test_a_replay_that_falls_back_to_sglangs_kernel_compiles_nothing_after_the_warm_up(
    req_to_token_1m,
):
    """Each op's kernels behind a :class:`Fallback` as the selection hook installs them (SGLang's
    kernel behind ours), warmed up per captured bs as the capture hook does
    (``Fallback.warm_up``); then ours raises at every replay, so each replay runs SGLang's kernel
    for the first time at its bs: no compile."""
    backends = {
        op: CapturedBuffers(req_to_token_1m, max_bs=64, next_n=5, page_size=64, topk=2048)
        for op in OPS
    }
    armed = []

    def ours_until_armed(op):
        kernel = kernel_for(op, "bounded")

        def call(**kwargs):
            if armed:
                raise RuntimeError("injected failure")
            return kernel(**kwargs)

        return call

    guarded = {
        op: Fallback(ours_until_armed(op), kernel_for(op, "sglang"), what=f"DSA {op}") for op in OPS
    }
    sglang = metadata_module()
    sglang_kernels = (
        sglang._fused_dsa_decode_metadata_kernel,
        sglang._fused_dsa_target_verify_metadata_kernel,
        sglang._fused_dsa_draft_extend_metadata_kernel,
    )
    forget_compiled(*KERNELS, *sglang_kernels)
    with count_compiles() as warm_up_compiles:
        for bs in CAPTURED:
            for op, buffers in backends.items():
                guarded[op].warm_up(**buffers.replay_kwargs(op, bs))
    for kernel in sglang_kernels:
        assert warm_up_compiles.of(kernel) >= 1, f"{kernel} was not warmed up"
    assert all(not fallback.failed for fallback in guarded.values()), "a warm-up of ours raised"

    armed.append(True)
    gen = torch.Generator().manual_seed(3)
    with count_compiles() as replay_compiles:
        for bs in CAPTURED:
            for _ in range(2):  # the replay that falls back, then one on SGLang's kernel for good
                seq_lens, slots = new_inputs(bs, req_to_token_1m, gen, odd_address=False)
                for op, buffers in backends.items():
                    kwargs = buffers.replay_kwargs(op, bs)
                    kwargs.update(seq_lens=seq_lens, req_pool_indices=slots)
                    guarded[op](**kwargs)
        torch.cuda.synchronize(req_to_token_1m.device)
    assert all(fallback.failed == set(CAPTURED) for fallback in guarded.values())
    assert replay_compiles.names == [], replay_compiles.describe()
