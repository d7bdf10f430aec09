"""The Triton compile counter the no-compile GPU tests share (``support.compiles``)."""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from support.compiles import count_compiles, forget_compiled


@triton.jit
def _add_one(x, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x + offs, tl.load(x + offs, mask=mask) + 1, mask=mask)


def report_compile(kernel, name):
    """What Triton does after it compiles ``kernel``: call the post-compile hook."""
    triton.knobs.runtime.jit_post_compile_hook(
        key=(),
        repr=f"{name}[num_warps=4]()",
        fn=SimpleNamespace(module=__name__, name=name, jit_function=kernel),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )


@pytest.mark.quick
def test_count_compiles_records_each_reported_compile_and_keeps_the_previous_hook(monkeypatch):
    earlier = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: earlier.append(kw["repr"])
    )
    previous = triton.knobs.runtime.jit_post_compile_hook
    with count_compiles() as seen:
        report_compile(_add_one, "_add_one")
        report_compile(_add_one, "_add_one")
    assert seen.names == [f"{__name__}._add_one"] * 2
    assert seen.of(_add_one) == 2 and seen.of(object()) == 0
    assert earlier == ["_add_one[num_warps=4]()"] * 2, "the hook set before still runs"
    assert triton.knobs.runtime.jit_post_compile_hook is previous, "and is put back"


def test_the_previous_hook_is_put_back_when_the_block_raises():
    previous = triton.knobs.runtime.jit_post_compile_hook
    with pytest.raises(RuntimeError):
        with count_compiles():
            raise RuntimeError("boom")
    assert triton.knobs.runtime.jit_post_compile_hook is previous


@pytest.mark.gpu
def test_a_new_specialization_compiles_once_and_a_forgotten_kernel_again():
    x = torch.zeros(16, device="cuda")
    forget_compiled(_add_one)
    with count_compiles() as first:
        _add_one[(1,)](x, 16, BLOCK=16)
        _add_one[(1,)](x, 16, BLOCK=16)
    with count_compiles() as second:
        _add_one[(1,)](x, 16, BLOCK=16)
        _add_one[(1,)](x.half(), 16, BLOCK=16)  # a new pointer dtype: a new variant
    forget_compiled(_add_one)
    with count_compiles() as third:
        _add_one[(1,)](x, 16, BLOCK=16)
    assert (first.of(_add_one), second.of(_add_one), third.of(_add_one)) == (1, 1, 1)
