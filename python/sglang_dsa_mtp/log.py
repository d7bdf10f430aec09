"""The plugin's logger. Every message starts with ``sglang_dsa_mtp:`` (SGLang's server log prints no
logger names), and a reason or a failure is logged once per process, not at every call."""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_dsa_mtp")
_seen: set[tuple] = set()


def log_once(level: int, key: tuple, msg: str, *args) -> bool:
    """Log ``msg % args`` at ``level`` the first time ``key`` is seen; return whether it logged."""
    if key in _seen:
        return False
    _seen.add(key)
    logger.log(level, msg, *args)
    return True


def log_failure(key: tuple, exc: BaseException, msg: str, *args) -> bool:
    """At ERROR, the first time ``key`` is seen: ``msg % args``, then the exception's type and text.

    Every hook site that catches an exception to keep SGLang's path logs it through here."""
    return log_once(logging.ERROR, key, msg + ": %s: %s", *args, type(exc).__name__, exc)


def gate_failure(exc: BaseException, keeps: str) -> str:
    """A hook site's gate raised: ``keeps`` (what stays SGLang's, in words) is logged with the
    exception, once at ERROR (:func:`log_failure`); returns the reason the site records."""
    log_failure(
        ("gate-failed", keeps, type(exc).__name__, str(exc)),
        exc,
        "sglang_dsa_mtp: %s: the gate raised",
        keeps,
    )
    return f"the gate raised {type(exc).__name__}: {exc}"
