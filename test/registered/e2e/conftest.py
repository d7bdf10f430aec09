"""Fixtures for the end-to-end kit's tests: a stand-in server on 127.0.0.1 that stops by itself.

``standin_server.py`` is importable from here: pytest puts this folder on ``sys.path``. The kit
imports SGLang (its server-argument parser, its GSM8K harness, its load client), so each
test module starts with ``require_sglang()`` (``support.sglang_import``).
"""

import pytest
from standin_server import StandIn


@pytest.fixture
def standin():
    """``standin(**kwargs)`` starts a StandIn in this process (at most 30 s, 64 requests unless
    told); every one started is stopped after the test."""
    started = []

    def start(**kwargs):
        server = StandIn(**{"lifetime_s": 30, **kwargs}).serve_in_background()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
