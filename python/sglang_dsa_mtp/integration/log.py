"""Logging helpers shared by the hook sites: every fallback reason is logged once per process."""

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
