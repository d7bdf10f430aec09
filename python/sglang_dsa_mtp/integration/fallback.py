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

:meth:`Fallback.warm_up` also binds ours's launch for the batch size (``launch.Binder.bind``: its
launcher chosen by a probe on twin buffers, logged once per op and choice), held in
:attr:`Fallback.bound` by ``bs``: a later call with the same buffers launches through it, any other
call goes through ours. A backend attribute holds :attr:`Fallback.installed` (:func:`fallback_of`
finds the fallback again); SGLang passes every argument by keyword.

This module imports no SGLang code, so that the host-time benchmark times what the server calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sglang_dsa_mtp.kernels.ops.launch import BoundLaunch, warm_up
from sglang_dsa_mtp.log import log_failure, log_once


class Fallback:
    """``ours`` with ``sglang`` as its per-``bs`` fallback; ``what`` names the operation in the log.

    ``failed`` holds the batch sizes that fell back; :meth:`fall_back` sends one there for good
    (when ours raises, at a replay or at its warm-up) and logs why, once. ``bound`` holds the
    launches of ours bound at warm-up, by ``bs``."""

    __slots__ = ("ours", "sglang", "what", "failed", "bound", "__weakref__")

    def __init__(self, ours: Callable, sglang: Callable, *, what: str):
        self.ours, self.sglang, self.what = ours, sglang, what
        self.failed: set = set()
        self.bound: dict[int, BoundLaunch] = {}

    @property
    def installed(self) -> Callable:
        """What a backend attribute holds in SGLang's kernel's place: the bound ``__call__``."""
        return self.__call__

    def __call__(self, *args, **kwargs):
        """Ours for the call (through the launch bound for its ``bs`` where that takes it), or
        SGLang's kernel for a ``bs`` that fell back."""
        bs = kwargs.get("bs")
        if bs not in self.failed:
            try:
                bound = self.bound.get(bs)
                if args or bound is None or not bound(kwargs):
                    return self.ours(*args, **kwargs)
                return None
            except Exception as exc:  # never take the server down: SGLang's kernel takes over
                self.fall_back(bs, exc)
        return self.sglang(*args, **kwargs)

    def warm_up(self, **kwargs) -> None:
        """Compile the variants that a call with these keyword arguments launches, ours and
        SGLang's, without writing any buffer of ``kwargs`` (:func:`launch.warm_up`'s twin buffers),
        then bind ours's launch for ``kwargs["bs"]`` where ours has a ``binder``. Ours raising sends
        that bs to SGLang's kernel, as the replay would have; SGLang's raising is logged once and
        changes nothing (a replay that falls back may then compile). Never raises. The caller
        checks that no CUDA graph is being captured (``launch.warm_up`` and the binding refuse to
        launch inside one, which would send the bs to SGLang's kernel)."""
        bs = kwargs.get("bs")
        try:
            warm_up(self.ours, **kwargs)
            binder = getattr(self.ours, "binder", None)
            if binder is not None:
                bound, why = binder.bind(**kwargs)
                log_launcher(self.what, why)
                if bound is not None:
                    self.bound[bs] = bound
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
        self.bound.pop(bs, None)
        self.failed.add(bs)
        log_failure(
            ("fallback", id(self), bs),
            exc,
            "sglang_dsa_mtp: %s for bs %s falls back to SGLang's kernel: ours raised",
            self.what,
            bs,
        )


def log_launcher(what: str, why: str) -> None:
    """Which launcher the launches of ``what`` were bound to at capture, and why (``Binder.bind``'s
    words): at INFO, once per op and outcome."""
    log_once(
        logging.INFO,
        ("launcher", what, why),
        "sglang_dsa_mtp: %s launches bound at capture: %s",
        what,
        why,
    )


def fallback_of(kernel) -> Fallback | None:
    """The :class:`Fallback` that ``kernel`` (a backend attribute) calls, else None."""
    owner = getattr(kernel, "fallback", None) or getattr(kernel, "__self__", None)
    return owner if isinstance(owner, Fallback) else None
