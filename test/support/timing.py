"""Timing on a CUDA device, shared by the GPU tests and the benchmarks.

The method of docs/baselines.md: CUDA-graph replays after a warm-up, medians, optionally a cold L2
(:func:`cuda_graph_time_us`), several arms' graphs replayed in turn (:func:`interleaved_graphs_us`);
host time per call of a Python-level launch (:func:`host_times_us`); and the floors printed beside
every figure: the launch gap of a one-element kernel in a graph (:func:`launch_floor_us`) and the
device-to-device copy bandwidth (:func:`copy_bandwidth_bytes_per_us`), both at once with their
words (:func:`graph_floors`, :func:`floors_text`); and the CUDA-graph memory pool one call holds at
its peak (:func:`graph_pool_peak_bytes`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def cuda_graph_time_us(
    fn: Callable[[], object], *, calls: int = 20, replays: int = 30, cold_l2: bool = False
) -> float:
    """Microseconds per call of ``fn``, replayed from a CUDA graph on the current CUDA device.

    ``calls`` back-to-back calls are captured in one graph, the graph is replayed ``replays`` times,
    each replay timed between two CUDA events, and the median replay is divided by ``calls``. With
    ``cold_l2`` every call is preceded by a 256 MiB memset, and a graph of the memsets alone, timed
    the same way, is subtracted: each call starts with a cold L2 cache.
    """
    if calls < 1 or replays < 1:
        raise ValueError(
            f"calls and replays must be at least 1, got calls={calls}, replays={replays}"
        )
    if not cold_l2:
        return _median_replay_us(lambda: [fn() for _ in range(calls)], replays) / calls
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def flushed_calls():
        for _ in range(calls):
            flush.zero_()
            fn()

    flushes_only = _median_replay_us(lambda: [flush.zero_() for _ in range(calls)], replays)
    return (_median_replay_us(flushed_calls, replays) - flushes_only) / calls


def _median_replay_us(body: Callable[[], object], replays: int) -> float:
    graph, _ = capture_graph(body)
    graph.replay()
    return statistics.median(replay_us(graph) for _ in range(replays))


def capture_graph(
    body: Callable[[], object], *, warmups: int = 1, capture_error_mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of one call of ``body``, and what that captured call returned.

    ``body`` first runs ``warmups`` times eagerly on a side stream (Triton compiles there, cuBLAS
    and communicators warm up; capture wants work off the default stream), then is captured.
    ``capture_error_mode`` is ``torch.cuda.graph``'s."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        result = body()
    return graph, result


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds of one replay of ``graph``, between two CUDA events on the current stream."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def interleaved_graphs_us(bodies: dict, calls: int, replays: int) -> dict:
    """Median microseconds per call of each of ``bodies``: each body's ``calls`` calls captured in
    one graph, every graph replayed once, then ``replays`` rounds that replay every graph once, in
    turn, so that clock and power drift reach all arms alike."""
    graphs = {
        name: capture_graph(lambda body=body: [body() for _ in range(calls)])[0]
        for name, body in bodies.items()
    }
    for graph in graphs.values():
        graph.replay()
    times = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            times[name].append(replay_us(graph))
    return {name: statistics.median(t) / calls for name, t in times.items()}


def launch_floor_us(calls: int = 20, replays: int = 30) -> float:
    """Microseconds per launch of a one-element kernel, replayed from a CUDA graph (hot L2)."""
    one = torch.zeros(1, device="cuda")
    return cuda_graph_time_us(lambda: one.add_(1), calls=calls, replays=replays)


def best_us(fn, calls: int, rounds: int) -> float:
    """Host microseconds per call of ``fn``: the best of ``rounds`` loops of ``calls`` calls (one
    call first, untimed; on CUDA the queue drained after each loop)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    return best


def written_call(fn, kwargs: dict):
    """A function of no arguments that calls ``fn`` with ``kwargs`` as a call site writes the call:
    every argument a keyword written in the call (a ``**dict`` Python passes another way, through
    one more dict), each value read from a variable. SGLang's replay calls its kernels so."""
    if not all(name.isidentifier() for name in kwargs):
        raise ValueError(f"kwargs must be named by identifiers, got {list(kwargs)}")
    keywords = ", ".join(f"{name}={name}" for name in kwargs)
    return eval(f"lambda fn, {', '.join(kwargs)}: lambda: fn({keywords})")(fn, **kwargs)


def host_times_us(fns: dict, *, calls: int = 200, repeats: int = 21) -> dict:
    """Host microseconds per call of each of ``fns``: ``calls`` back-to-back calls timed on the host
    clock (the GPU work is queued, not waited for), median of ``repeats`` rounds; each round times
    every function in turn, so that CPU clock drift reaches all alike, and drains the queue."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) * 1e6 / calls)
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth_bytes_per_us() -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return 2 * src.numel() / statistics.median(times)


def graph_floors() -> dict:
    """The two floors of a CUDA-graph benchmark, measured now: ``launch_floor_us`` and
    ``copy_bytes_per_us`` (:func:`launch_floor_us`, :func:`copy_bandwidth_bytes_per_us`)."""
    return dict(launch_floor_us=launch_floor_us(), copy_bytes_per_us=copy_bandwidth_bytes_per_us())


def floors_text(floors: dict) -> str:
    """:func:`graph_floors` in words, as a benchmark's header prints them."""
    return (
        f"launch floor {floors['launch_floor_us']:.2f} us, copy bandwidth "
        f"{floors['copy_bytes_per_us'] / 1e6:.2f} TB/s (read + write)"
    )


def graph_pool_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while one call of ``fn`` is captured in a CUDA graph: what the call needs
    of the graph's memory pool. ``fn`` runs once eagerly first (compiles, lazy buffers)."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    peak = torch.cuda.max_memory_allocated() - base
    del graph
    torch.cuda.synchronize()
    return peak
