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

A backend attribute holds the fallback's bound ``__call__`` (:attr:`Fallback.installed`;
:func:`fallback_of` finds the fallback again): Python calls a bound method through vectorcall, which
gathers SGLang's keyword arguments into one dict, but an instance of a class with a ``__call__``
through ``tp_call``, which gathers them twice (half a microsecond for the decode call's 13 keywords on
CPython 3.11; from 16 keywords on, as target verify and draft extend pass, one dict costs about as
much as two smaller ones).

This module imports no SGLang code, so that the host-time benchmark times what the server calls.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_dsa_mtp.kernels.ops.launch import keyword_call, warm_up
from sglang_dsa_mtp.log import log_failure


class Fallback:
    """``ours`` with ``sglang`` as its per-``bs`` fallback; ``what`` names the operation in the log.

    ``failed`` holds the batch sizes that fell back; :meth:`fall_back` sends one there for good
    (when ours raises, at a replay or at its warm-up) and logs why, once."""

    __slots__ = ("_ours", "_ours_by_keyword", "sglang", "what", "failed")

    def __init__(self, ours: Callable, sglang: Callable, *, what: str):
        self.ours, self.sglang, self.what = ours, sglang, what
        self.failed: set = set()

    @property
    def ours(self) -> Callable:
        return self._ours

    @ours.setter
    def ours(self, ours: Callable) -> None:
        # SGLang calls by keyword: ``ours(**kwargs)`` as one call of the dict (launch.keyword_call)
        self._ours, self._ours_by_keyword = ours, keyword_call(ours)

    @property
    def installed(self) -> Callable:
        """What a backend attribute holds in SGLang's kernel's place: the bound ``__call__``."""
        return self.__call__

    def __call__(self, *args, **kwargs):
        bs = kwargs.get("bs")
        if bs not in self.failed:
            try:
                if args:
                    return self._ours(*args, **kwargs)
                return self._ours_by_keyword(kwargs)
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
    owner = getattr(kernel, "__self__", None)
    return owner if isinstance(owner, Fallback) else None
