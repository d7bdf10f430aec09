"""One typed state object per SGLang object (``integration/state.py``): a kind asked of an object
that holds another is a TypeError naming both, never a state of the wrong kind."""

import pytest

from sglang_dsa_mtp.integration.state import (
    ATTR,
    BackendState,
    MultiStepState,
    ProcessorState,
    peek,
    state_of,
)

KINDS = (BackendState, MultiStepState, ProcessorState)


class SGLangObject:
    """Any object the hooks keep a state on."""


@pytest.mark.quick
@pytest.mark.parametrize("kind", KINDS)
def test_state_of_creates_one_state_and_returns_it_again(kind):
    obj = SGLangObject()
    assert peek(obj, kind) == kind() and ATTR not in vars(obj)
    state = state_of(obj, kind)
    assert isinstance(state, kind) and vars(obj)[ATTR] is state
    assert state_of(obj, kind) is state and peek(obj, kind) is state


@pytest.mark.parametrize(
    "held,asked",
    [(held, asked) for held in KINDS for asked in KINDS if held is not asked],
    ids=lambda kind: kind.__name__,
)
@pytest.mark.parametrize("read", [state_of, peek], ids=["state_of", "peek"])
def test_a_state_of_another_kind_is_a_type_error_naming_both(held, asked, read):
    obj = SGLangObject()
    state = state_of(obj, held)
    with pytest.raises(TypeError, match=rf"holds a {held.__name__} .* not a {asked.__name__}"):
        read(obj, asked)
    assert vars(obj)[ATTR] is state
