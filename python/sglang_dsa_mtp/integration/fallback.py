"""SGLang's own kernel behind each of ours, per batch size: the replay path never raises because of us.

The bounded replay-metadata kernels run inside SGLang's ``_apply_cuda_graph_metadata`` before every
CUDA-graph replay, where an exception would take the server down. :class:`Fallback` wraps one of
them: called with SGLang's arguments, it runs ours; if ours raises, it logs the reason once at ERROR
and runs the kernel SGLang had selected with the same arguments instead, then and at every later call
with that ``bs``. SGLang's kernel writes the whole region ours writes (the outputs are bit-identical
by contract), so whatever ours left half done is overwritten. Other batch sizes keep ours.

This module imports no SGLang code, so that the host-time benchmark times what the server calls.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_dsa_mtp.log import log_failure


class Fallback:
    """``ours`` with ``sglang`` as its per-``bs`` fallback; ``what`` names the operation in the log.

    ``failed`` holds the batch sizes that fell back; :meth:`fall_back` sends one there for good
    (when ours raises, at a replay or at its warm-up) and logs why, once."""

    __slots__ = ("ours", "sglang", "what", "failed")

    def __init__(self, ours: Callable, sglang: Callable, *, what: str):
        self.ours, self.sglang, self.what = ours, sglang, what
        self.failed: set = set()

    def __call__(self, *args, **kwargs):
        bs = kwargs.get("bs")
        if bs not in self.failed:
            try:
                return self.ours(*args, **kwargs)
            except Exception as exc:  # never take the server down: SGLang's kernel takes over
                self.fall_back(bs, exc)
        return self.sglang(*args, **kwargs)

    def fall_back(self, bs, exc: BaseException) -> None:
        self.failed.add(bs)
        log_failure(
            ("fallback", id(self), bs),
            exc,
            "sglang_dsa_mtp: %s for bs %s falls back to SGLang's kernel: ours raised",
            self.what,
            bs,
        )
