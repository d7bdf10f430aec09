"""Launching a server process per instance, and the kit's HTTP calls."""

import os
import socket
import sys

import pytest
import standin_server

from support.sglang_import import require_sglang

require_sglang()

import requests  # noqa: E402

from support.e2e import server as server_module  # noqa: E402
from support.e2e.protocol import arm_env  # noqa: E402
from support.e2e.server import flush_cache, generate, launch  # noqa: E402


@pytest.fixture(autouse=True)
def fast_health_polls(monkeypatch):
    monkeypatch.setattr(server_module, "HEALTH_POLL_S", 0.05)


STANDIN_SCRIPT = standin_server.__file__


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    "arm, switches",
    [("stock", ["0", "0", "0", "0"]), ("plugin", [None, None, None, None])],
)
def test_launch_waits_for_health_runs_with_the_arm_switches_and_stops_the_server(
    tmp_path, arm, switches
):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, STANDIN_SCRIPT, str(port), "30"]
    env = arm_env(arm, {**os.environ, "SGLANG_DSA_BOUNDED_REPLAY_METADATA": "1"})
    with launch(command, env, tmp_path / "server.log", url, startup_timeout_s=30) as base_url:
        assert base_url == url
        info = requests.get(f"{url}/server_info", timeout=5).json()
        assert list(info["switches"].values()) == switches
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)


def test_a_server_that_exits_before_it_is_healthy_is_an_error_naming_its_log(tmp_path):
    log = tmp_path / "server.log"
    command = [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=f"exited with status 3 .*see {log}"):
        with launch(command, os.environ, log, f"http://127.0.0.1:{_free_port()}", 30):
            pass
    assert log.read_text() == "bad flag\n"


def test_a_server_never_healthy_times_out_and_is_stopped(tmp_path):
    log = tmp_path / "server.log"
    command = [
        sys.executable,
        "-c",
        "import os, time; print(os.getpid(), flush=True); time.sleep(60)",
    ]
    with pytest.raises(TimeoutError, match=f"did not answer 200 within 0.5 s; see {log}"):
        with launch(command, os.environ, log, f"http://127.0.0.1:{_free_port()}", 0.5):
            pass
    with pytest.raises(ProcessLookupError):
        os.kill(int(log.read_text()), 0)


@pytest.mark.quick
def test_generate_and_flush_cache_talk_to_the_server(standin):
    server = standin(max_requests=1)
    answer = generate(
        server.base_url, {"text": "2 + 2 =", "sampling_params": {"max_new_tokens": 8}}
    )
    assert answer["text"] == "The answer is 42."
    flush_cache(server.base_url)
    assert server.flushes == 1


def test_a_refused_request_is_an_error_with_the_server_answer(standin):
    server = standin(max_requests=0)
    with pytest.raises(RuntimeError, match="/generate: HTTP 503: .*request budget spent"):
        generate(server.base_url, {"text": "x", "sampling_params": {"max_new_tokens": 8}})


def test_serve_each_instance_launches_the_interleaved_order_with_each_arms_switches(
    tmp_path, monkeypatch
):
    from contextlib import contextmanager

    from sglang_dsa_mtp.switches import SWITCHES
    from support.e2e.protocol import INSTANCE_ORDER

    events = []

    @contextmanager
    def fake_launch(command, env, log_path, base_url, startup_timeout_s):
        switches = [env.get(switch.env) for switch in SWITCHES]
        events.append(("up", log_path.name, switches, base_url, startup_timeout_s))
        yield base_url
        events.append(("down", log_path.name))

    monkeypatch.setattr(server_module, "launch", fake_launch)
    ran = []
    server_module.serve_each_instance(
        ["--port", "30000"], "http://127.0.0.1:30000", tmp_path, 12.0, ran.append
    )
    assert ran == list(INSTANCE_ORDER)
    expected = []
    for instance in INSTANCE_ORDER:
        switches = [("0" if instance.arm == "stock" else None) for _ in SWITCHES]
        name = f"{instance.tag}.server.log"
        expected += [("up", name, switches, "http://127.0.0.1:30000", 12.0), ("down", name)]
    assert events == expected
