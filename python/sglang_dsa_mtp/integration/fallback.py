"""SGLang's own kernel behind each of ours, per batch size: the replay path never raises because of us.

The bounded replay-metadata kernels run inside SGLang's ``_apply_cuda_graph_metadata`` before every
CUDA-graph replay, where an exception would take the server down. :class:`Fallback` wraps one of
them: called with SGLang's arguments, it runs ours; if ours raises, it logs the reason once at ERROR
and runs the kernel SGLang had selected with the same arguments instead, then and at every later call
with that ``bs``. SGLang's kernel writes the whole region ours writes (the outputs are bit-identical
by contract), so whatever ours left half done is overwritten. Other batch sizes keep ours.

Both kernels specialize on the batch size (SGLang's takes ``bs`` as a ``tl.constexpr``), so either
one's first call at a batch size compiles. :meth:`Fallback.warm_up`, called at capture for every
captured batch size (``dsa_metadata_capture``), compiles both on twin buffers (``launch.warm_up``):
neither our replay nor a replay that falls back compiles while serving.

A backend attribute holds what :attr:`Fallback.installed` returns (:func:`fallback_of` finds the
fallback again). SGLang passes every argument by keyword. Where ours is a wrapper with launch plans,
the installed function has its signature (``LaunchPlans.planned``): Python binds SGLang's keywords
straight to its parameters, no dict gathered, and it launches through the plan of the call's key,
computed in its own frame; any other call (no plan yet, a ``bs`` that fell back, another ``ours``)
goes to :meth:`Fallback.__call__` with the same arguments. Elsewhere it is the bound ``__call__``.

This module imports no SGLang code, so that the host-time benchmark times what the server calls.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_dsa_mtp.kernels.ops.launch import EVERY, MISSING, LaunchPlans, set_unless, warm_up
from sglang_dsa_mtp.log import log_failure


class Fallback:
    """``ours`` with ``sglang`` as its per-``bs`` fallback; ``what`` names the operation in the log.

    ``failed`` holds the batch sizes that fell back; :meth:`fall_back` sends one there for good
    (when ours raises, at a replay or at its warm-up) and logs why, once."""

    __slots__ = ("_ours", "sglang", "what", "failed", "_planned", "_installed", "__weakref__")

    def __init__(self, ours: Callable, sglang: Callable, *, what: str):
        self.sglang, self.what = sglang, what
        self.failed: set = set()
        plans = getattr(ours, "launch_plans", None)
        self._planned, self._installed = ours, None
        if isinstance(plans, LaunchPlans) and plans.wrapper is ours:
            self._installed = plans.planned(self._on_miss, unless=self.failed)
        if self._installed is not None:
            self._installed.fallback = self
        self.ours = ours

    @property
    def ours(self) -> Callable:
        return self._ours

    @ours.setter
    def ours(self, ours: Callable) -> None:
        # The planned function stands in for the ours it was made for: another ours takes
        # every call through __call__.
        self._ours = ours
        if self._installed is not None:
            set_unless(self._installed, self.failed if ours is self._planned else EVERY)

    @property
    def installed(self) -> Callable:
        """What a backend attribute holds in SGLang's kernel's place: ours's planned function
        where ours has launch plans, else the bound ``__call__``."""
        return self.__call__ if self._installed is None else self._installed

    def _on_miss(self, rest: dict, **arguments):
        """The planned function's call that its plan did not take: by keyword, through
        :meth:`__call__` (an argument SGLang did not pass left out)."""
        kwargs = {name: v for name, v in arguments.items() if v is not MISSING}
        kwargs.update(rest)
        return self(**kwargs)

    def __call__(self, *args, **kwargs):
        bs = kwargs.get("bs")
        if bs not in self.failed:
            try:
                return self.ours(*args, **kwargs)
            except Exception as exc:  # never take the server down: SGLang's kernel takes over
                self.fall_back(bs, exc)
        return self.sglang(*args, **kwargs)

    def warm_up(self, **kwargs) -> None:
        """Compile the variants that a call with these keyword arguments launches, ours and
        SGLang's, without writing any buffer of ``kwargs`` (:func:`launch.warm_up`'s twin buffers).
        Ours raising sends ``kwargs["bs"]`` to SGLang's kernel, as the replay would have; SGLang's
        raising is logged once and changes nothing (a replay that falls back may then compile).
        Never raises. The caller checks that no CUDA graph is being captured (``launch.warm_up``
        refuses to launch inside one, which would send the bs to SGLang's kernel)."""
        bs = kwargs.get("bs")
        try:
            warm_up(self.ours, **kwargs)
        except Exception as exc:  # never take the capture down: SGLang's kernel takes this bs
            self.fall_back(bs, exc)
        try:
            warm_up(self.sglang, **kwargs)
        except Exception as exc:  # ours keeps the replays; only a fallback would compile
            log_failure(
                ("sglang-warm-up", id(self)),
                exc,
                "sglang_dsa_mtp: warming up SGLang's %s kernel for bs %s failed (a replay that "
                "falls back to it compiles it first)",
                self.what,
                bs,
            )

    def fall_back(self, bs, exc: BaseException) -> None:
        self.failed.add(bs)
        log_failure(
            ("fallback", id(self), bs),
            exc,
            "sglang_dsa_mtp: %s for bs %s falls back to SGLang's kernel: ours raised",
            self.what,
            bs,
        )


def fallback_of(kernel) -> Fallback | None:
    """The :class:`Fallback` that ``kernel`` (a backend attribute) calls, else None."""
    owner = getattr(kernel, "fallback", None) or getattr(kernel, "__self__", None)
    return owner if isinstance(owner, Fallback) else None
