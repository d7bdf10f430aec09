"""SGLang's own kernel behind each of ours, per batch size: the replay path never raises because of us.

The bounded replay-metadata kernels run inside SGLang's ``_apply_cuda_graph_metadata`` before every
CUDA-graph replay, where an exception would take the server down. :func:`with_fallback` wraps one of
them: called with SGLang's arguments, it runs ours; if ours raises, it logs the reason once at ERROR
and runs the kernel SGLang had selected with the same arguments instead, then and at every later call
with that ``bs``. SGLang's kernel writes the whole region ours writes (the outputs are bit-identical
by contract), so whatever ours left half done is overwritten. Other batch sizes keep ours.

This module imports no SGLang code, so that the host-time benchmark times what the server calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sglang_dsa_mtp.integration.log import log_once


def with_fallback(ours: Callable, sglang: Callable, *, what: str) -> Callable:
    """``ours`` with ``sglang`` as its per-``bs`` fallback; ``what`` names the operation in the log.

    The returned callable has ``ours``, ``sglang``, ``failed`` (the batch sizes that fell back) and
    ``fall_back(bs, exc)``, which sends ``bs`` to SGLang's kernel for good (used when ours raises,
    at a replay or at its warm-up) and logs why, once.
    """
    failed: set = set()

    def fall_back(bs, exc: BaseException) -> None:
        failed.add(bs)
        log_once(
            logging.ERROR,
            ("fallback", id(failed), bs),
            "sglang_dsa_mtp: %s for bs %s falls back to SGLang's kernel: ours raised %s: %s",
            what,
            bs,
            type(exc).__name__,
            exc,
        )

    def call(*args, **kwargs):
        bs = kwargs.get("bs")
        if bs not in failed:
            try:
                return ours(*args, **kwargs)
            except Exception as exc:  # never take the server down: SGLang's kernel takes over
                fall_back(bs, exc)
        return sglang(*args, **kwargs)

    call.ours, call.sglang, call.failed, call.fall_back = ours, sglang, failed, fall_back
    return call
