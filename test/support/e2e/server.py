"""One server process per instance, and the HTTP calls the kit makes to a server.

``launch`` starts a command in its own process group (SGLang's server spawns scheduler and
detokenizer processes), with its output in a log file, waits until ``GET /health`` answers 200,
and on leaving stops the whole group: SIGTERM, then SIGKILL for whatever is left after a grace
period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import requests

from support.e2e.protocol import INSTANCE_ORDER, Instance, arm_env, server_command

HEALTH_POLL_S = 1.0
STOP_GRACE_S = 60.0
REQUEST_TIMEOUT_S = 1800.0


@contextmanager
def launch(
    command: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    base_url: str,
    startup_timeout_s: float,
) -> Iterator[str]:
    """Run ``command`` until the block ends; yields ``base_url`` once ``/health`` answers 200.

    Raises RuntimeError when the process exits before it is healthy, TimeoutError when it is not
    healthy within ``startup_timeout_s``; the log file is named in both.
    """
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            list(command),
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_healthy(process, base_url, log_path, startup_timeout_s)
            yield base_url
        finally:
            _stop(process)


def _wait_healthy(process, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server exited with status {process.returncode} before {base_url}/health "
                f"answered; see {log_path}"
            )
        try:
            if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{base_url}/health did not answer 200 within {timeout_s:g} s; see {log_path}"
            )
        time.sleep(HEALTH_POLL_S)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the group, up to STOP_GRACE_S for the server to exit, then SIGKILL to whatever
    is left of the group."""
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # the group is empty
        pass


def _check(response: requests.Response, what: str) -> requests.Response:
    if response.status_code != 200:
        raise RuntimeError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
    return response


def generate(base_url: str, payload: dict) -> dict | list:
    """``POST /generate`` without streaming; the server's JSON answer (a list for a batch)."""
    response = requests.post(f"{base_url}/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    return _check(response, f"{base_url}/generate").json()


def flush_cache(base_url: str) -> None:
    """Empty the server's radix cache (SGLang refuses while requests are running)."""
    _check(requests.post(f"{base_url}/flush_cache", timeout=60), f"{base_url}/flush_cache")


def serve_each_instance(
    server_args: Sequence[str],
    base_url: str,
    out_dir: Path,
    startup_timeout_s: float,
    run: Callable[[Instance], object],
) -> None:
    """Every instance of ``INSTANCE_ORDER`` in turn: launched with its arm's kill switches and its
    log at ``<out_dir>/<tag>.server.log``, ``run(instance)`` while it is healthy, then stopped."""
    for instance in INSTANCE_ORDER:
        env = arm_env(instance.arm, os.environ)
        log_path = out_dir / f"{instance.tag}.server.log"
        with launch(server_command(server_args), env, log_path, base_url, startup_timeout_s):
            run(instance)
