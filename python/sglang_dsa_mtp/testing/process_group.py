"""Spawn a group of processes for the multi-process tests (a TP group of CPU or GPU ranks).

:func:`run_group` starts ``fn(rank, world, init_method, *args)`` in ``world`` processes and waits;
each worker writes a ``rank<r>.json`` report that :func:`read_reports` reads back.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(fn: Callable, world: int, *args, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, world, init_method, *args)`` in ``world`` spawned processes and wait.

    A process that raises makes this raise (with its traceback); the others are terminated. Past
    ``timeout_s`` every process still alive is terminated and TimeoutError is raised.
    """
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(
        fn, args=(world, init_method, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-process group did not finish in {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def read_reports(result_dir: str, world: int) -> list[dict]:
    """The ``rank<r>.json`` reports :func:`exchange_tp_worker` wrote, one per rank."""
    return [
        json.loads(Path(result_dir, f"rank{rank}.json").read_text())
        for rank in range(world)
        if os.path.exists(Path(result_dir, f"rank{rank}.json"))
    ]
