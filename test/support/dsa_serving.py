"""One EAGLE server's DSA attention backends as a server process holds them, on a CUDA GPU or the
CPU: built by SGLang 0.5.23's own constructors, graph state sized by its ``init_cuda_graph_state``,
every batch size SGLang captures captured and replayed through the calls its graph runners make,
with the plugin on and off side by side (the serving loop on top: ``serving_loop``).

What runs is SGLang's code with the plugin's hooks applied by SGLang's plugin loader
(:func:`~support.dsa_backends.load_plugin`), minus the model. The stand-ins, on every
device, are only for what a GPU machine without SGLang's native dependencies lacks
(:func:`~support.dsa_backends.cuda_stand_ins` installs them, each a deterministic torch
function of its inputs):

- ``sgl_kernel`` (imported by SGLang at module level, never called here): stubbed where it is not
  installed (:mod:`~support.sglang_stubs`; :func:`prepare` installs the stubs);
- DeepGEMM's paged-MQA schedule (``get_paged_mqa_logits_metadata``) and SM count;
- SGLang's JIT top-k v2 plan (``plan_topk_v2``) and FlashMLA's tile metadata;
- SGLang's JIT metadata copies (``fused_metadata_copy_cuda`` / ``_multi_cuda``): they raise, so
  SGLang's draft decode takes its own fallback, torch copies with every step's plans refreshed;
- for the verify input only, SGLang's CUDA tree builder (a JIT build): its Triton builder (SGLang's
  XPU path, the same tree), as in ``verify_tree``.

Off a GPU, besides (``cuda_stand_ins``): the device capability, ``is_cuda``, and SGLang's
replay-metadata kernels from its files with the ``is_cuda`` asserts compiled out (Triton's
interpreter runs them and ours).

The pieces:

- :class:`Sizes` (:data:`GPU_SIZES`, :func:`cpu_sizes`): the context, the max batch size
  (``--cuda-graph-max-bs-decode`` and ``--max-running-requests``), the request slots, the index top-k;
- :func:`launch` publishes the EAGLE launch to SGLang's runtime context and resolves the batch
  sizes SGLang captures for it (SGLang's ``generate_decode_cuda_graph_batch_sizes`` as its server
  args resolve them, filtered by the graph runners' ``get_batch_sizes_to_capture``);
- :class:`Graphs`: one ``torch.cuda.CUDAGraph`` per batch size and runner, captured as SGLang's full
  graph backend captures (two eager warm-ups, then ``torch.cuda.graph`` on the capture stream into one
  pool); on the CPU the capture calls the body and a replay calls it again;
- :class:`Runner`: one of SGLang's graph runners as the attention backend sees it (the target's
  verify runner, the draft-extend runner, the draft-decode runner): its static input buffers, the
  forward batch it hands ``init_forward_metadata_out_graph`` at capture and at each replay (padded
  to the captured batch size as it pads), and a graph whose body is the runner's
  ``init_forward_metadata_in_graph`` followed by a stand-in for the model: it copies every metadata
  tensor SGLang's attention reads (:data:`READ`) into outputs that outlive the graph, so that what
  is compared after a replay is what a captured graph read;
- :class:`Arm`: the target, draft-extend and multi-step backends of one server with the plugin's
  kill switches set one way (:data:`ON`, :data:`OFF`), each arm with its own graphs, recaptured
  mid-run as SGLang recaptures while serving (:meth:`Arm.recapture`);
- :func:`differences`: what differs between the two arms' reads of one replay, bit for bit.

A request slot's ``req_to_token`` row is shared by both arms (SGLang's kernels and ours only read it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Optional

import torch

from support import dsa_backends as kit
from support.constants import CONTEXT_1M
from support.reference import metadata_module
from support.sglang_stubs import install_native_stubs

BOUNDED_ENV, LIVE_ENV = "SGLANG_DSA_BOUNDED_REPLAY_METADATA", "SGLANG_DSA_LIVE_WIDTH"
GLUE_ENV = "SGLANG_DSA_METADATA_GLUE"
ON = {BOUNDED_ENV: "1", LIVE_ENV: "1", GLUE_ENV: "1"}  # the plugin's defaults
OFF = {BOUNDED_ENV: "0", LIVE_ENV: "0", GLUE_ENV: "0"}  # every kill switch: SGLang's own paths
OPS = ("target verify", "draft extend", "draft decode")
DECODE = "decode"  # the one runner of a server without speculative decoding
FILL = 1  # DSA's get_cuda_graph_seq_len_fill_value: the seq_len of a padded graph row
# The tensors of a batch size's DSAMetadata that the captured forward reads, compared whole
# (``real_page_table``: the 128-column blocks SGLang's kernels write, see ``differences``). Each must
# be a tensor on both arms, and every tensor of the metadata must be here or in UNREAD
# (``metadata_reads``).
READ = (
    "cache_seqlens_int32",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "real_page_table",
    "dsa_cache_seqlens_int32",
    "dsa_cu_seqlens_q",
    "dsa_cu_seqlens_k",
    "dsa_seqlens_expanded",
    "flashmla_metadata.num_splits",
    "flashmla_metadata.flashmla_metadata",
    "paged_mqa_schedule_metadata",
    "paged_mqa_ctx_lens_2d",
    "topk_v2_plan",
)
# The metadata's tensors that no captured forward of this path reads, and why.
UNREAD = {
    "page_table_1": "nothing on this path reads it (SGLang's own drop condition, docs/switches.md); "
    "the plugin drops it",
}
# SGLang 0.5.23's replay-metadata kernels write a row's page-table entries in blocks of this many
# token columns (their ``block_n``): every entry of token columns ``c < 128 * cdiv(kv_len, 128)``
# (and below the table's width), nothing past them.
SGLANG_BLOCK_N = 128
# The host-side fields of the metadata, compared after capture.
STATIC = ("page_size", "max_seq_len_q", "max_seq_len_k", "dsa_extend_seq_lens_list")
# What only the indexer reads: seeded draft steps (GLM-5 with index share) run no indexer, and the
# plugin's one launch leaves these untouched there while SGLang refreshes them.
INDEXER_PLANS = ("paged_mqa_schedule_metadata", "topk_v2_plan", "paged_mqa_ctx_lens_2d")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The server the slice stands for."""

    device: torch.device
    context: int  # --context-length
    max_bs: int  # --cuda-graph-max-bs-decode = --max-running-requests
    pool: int  # request slots (req_to_token rows); slot 0 is SGLang's padding slot, all zeros
    index_topk: int  # the model's index top-k (GLM-5: 2048)
    long_from: int  # a request past this many tokens is "long"
    page_size: int = 64

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


GPU_SIZES = Sizes(
    device=torch.device("cuda"),
    context=CONTEXT_1M,
    max_bs=48,
    pool=2 * 48 + 1,
    index_topk=2048,
    long_from=64 * 1024,
)


def cpu_sizes(max_bs: int = 5) -> Sizes:
    """The CPU form: a 128-token context (tables 136 to 138 columns: two 128-column blocks, the
    second partial, three pages), SGLang's capture list up to ``max_bs`` (1 .. 5 by default: room
    for the serving loop's four distinct fault victims below the largest), an index top-k of 48
    (below most lengths, so that SGLang's ``min(length, top-k)`` clips), "long" past 32 tokens."""
    return Sizes(
        device=torch.device("cpu"),
        context=128,
        max_bs=max_bs,
        pool=2 * max_bs + 1,
        index_topk=48,
        long_from=32,
    )


def prepare(monkeypatch, device: torch.device, *, real=()) -> kit.StandIns:
    """Before a slice is built, once per test or run: ``sgl_kernel`` stubbed where absent, the
    plugin loaded by SGLang's plugin loader, the stand-ins installed but for the leaves named in
    ``real`` (``kit.cuda_stand_ins``; all undone with ``monkeypatch``, but the hooks: see
    ``load_plugin``)."""
    install_native_stubs()
    kit.load_plugin(monkeypatch)
    return kit.cuda_stand_ins(monkeypatch, real=real)


@contextlib.contextmanager
def switches(env: dict[str, str]) -> Iterator[None]:
    """The kill switches set as ``env`` says inside the block (as a server's environment would),
    restored after it. The hooks read them when a backend is built, when its graph state is sized
    and when a batch size is captured (the indexer hook: at every call)."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def swapped(module, values: dict) -> Iterator[None]:
    """``module``'s attributes set to ``values`` inside the block, restored after it."""
    previous = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


@contextlib.contextmanager
def launch(name: str, sizes: Sizes, **extra) -> Iterator[tuple[object, list[int]]]:
    """The EAGLE launch ``name`` (a key of ``dsa_backends.LAUNCHES``) published with
    ``--cuda-graph-max-bs-decode`` and ``--max-running-requests`` at ``sizes.max_bs`` and the server
    arguments ``extra``; yields (the published ServerArgs, the batch sizes SGLang's graph runners
    capture, ascending).

    SGLang resolves the capture list when its server args resolve (its memory hook calls
    ``generate_decode_cuda_graph_batch_sizes`` for the decode phase's max bs on a GPU device); the
    published args carry that list as ``cuda_graph_config``, and ``get_batch_sizes_to_capture`` (every
    graph runner's) filters it for a ``req_to_token`` pool of ``sizes.pool`` slots."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.model_executor.cuda_graph_config import (
        Phase,
        default_cuda_graph_config,
        with_phase,
    )
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import (
        get_batch_sizes_to_capture,
    )

    fields = dict(max_running_requests=sizes.max_bs, cuda_graph_max_bs_decode=sizes.max_bs)
    fields.update(extra)
    with kit.serving(name, **fields) as server_args:
        listed = generate_decode_cuda_graph_batch_sizes(server_args, sizes.max_bs)
    config = with_phase(default_cuda_graph_config(), Phase.DECODE, max_bs=sizes.max_bs, bs=listed)
    with kit.serving(name, cuda_graph_config=config, **fields) as server_args:
        runner = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(size=sizes.pool), server_args=server_args
        )
        captured, _ = get_batch_sizes_to_capture(runner)
        yield server_args, list(captured)


def sglang_metadata_kernels(device: torch.device) -> dict:
    """SGLang's three replay-metadata kernels for the arm with the plugin off: on a GPU, their own
    file loaded a second time, so that the two arms' Triton caches are apart and a compile of one
    arm never stands for the other's (on the CPU, what ``cuda_stand_ins`` installed: nothing
    compiles there)."""
    import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager

    if device.type != "cuda":
        return {name: getattr(manager, name) for name in kit.SGLANG_METADATA_KERNELS}
    module = metadata_module()
    return {name: getattr(module, name) for name in kit.SGLANG_METADATA_KERNELS}


class Graphs:
    """The captured graphs of one arm, keyed by (op, bs), in one memory pool, captured on one capture
    stream as SGLang's full CUDA-graph backend captures (``capture_one``: synchronize, two eager
    warm-up runs of the body, then the body inside ``torch.cuda.graph(pool=..., stream=...)``).
    Without CUDA, a capture runs the body once and a replay runs it again."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.stream = torch.cuda.Stream() if self.cuda else None
        self._graphs: dict = {}

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The capture session: SGLang's graph runners capture (and build each batch size's
        metadata) with the capture stream current and Python's garbage collector frozen
        (SGLang's ``freeze_gc``: each capture collects)."""
        if not self.cuda:
            yield
            return
        gc.collect()
        gc.freeze()
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch.cuda.current_stream().wait_stream(self.stream)
            gc.unfreeze()

    def capture(self, key, body: Callable[[], None]) -> None:
        if not self.cuda:
            body()
            self._graphs[key] = body
            return
        torch.cuda.synchronize()
        for _ in range(2):
            body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            body()
        self._graphs[key] = graph

    def replay(self, key) -> None:
        graph = self._graphs[key]
        if self.cuda:
            graph.replay()
        else:
            graph()

    def pool_bytes(self) -> Optional[int]:
        """Bytes of the CUDA caching allocator's segments in this arm's graph pool (None off a GPU)."""
        if not self.cuda:
            return None
        return sum(
            segment["total_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment.get("segment_pool_id", ())) == tuple(self.pool)
        )


class UncomparedMetadata(LookupError):
    """A ``DSAMetadata`` tensor the comparison would leave out: a :data:`READ` name missing or None,
    or a tensor in neither :data:`READ` nor :data:`UNREAD`."""


def metadata_tensors(metadata) -> dict[str, torch.Tensor]:
    """Every tensor of one ``DSAMetadata`` by name: its tensor fields, and ``field.leaf`` for the
    tensors of a field that holds some (FlashMLA's ``flashmla_metadata``)."""
    out = {}
    for name, value in vars(metadata).items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif hasattr(value, "__dict__"):
            out.update(
                (f"{name}.{leaf}", v)
                for leaf, v in vars(value).items()
                if isinstance(v, torch.Tensor)
            )
    return out


def metadata_reads(metadata) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(the tensors of one ``DSAMetadata`` the forward reads, by :data:`READ` name; its
    :data:`STATIC` host fields). Raises :class:`UncomparedMetadata` naming every :data:`READ`
    name that is missing or None, and every tensor that is neither read nor :data:`UNREAD`."""
    tensors = metadata_tensors(metadata)
    missing = [name for name in READ if name not in tensors]
    unlisted = sorted(set(tensors) - set(READ) - set(UNREAD))
    if missing or unlisted:
        raise UncomparedMetadata(
            f"{type(metadata).__name__}: missing or None: {missing}; tensors in neither READ nor "
            f"UNREAD: {unlisted}"
        )
    return {name: tensors[name] for name in READ}, {
        name: getattr(metadata, name) for name in STATIC
    }


def decode_runner(backend, mode, *, seq_lens, req_pool_indices, max_tokens: int):
    """SGLang's ``DecodeCudaGraphRunner`` as its replay prep sees it (``load_batch`` ->
    ``_init_replay_attn_metadata``): the runner holds ``backend``, captures ``mode``, and its input
    buffers are ``seq_lens`` / ``req_pool_indices`` (the harness's runner's); no pdmux, two-batch
    overlap, LoRA or DP gather, EAGLE speculative decoding; SGLang's own metadata glue as its
    constructor sets it from ``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` and
    ``SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW`` (both off by default; EAGLE asks no backend to glue).
    Built without its constructor (which captures a model's graphs): every attribute set here is
    one its replay prep reads."""
    from sglang.srt.environ import envs
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    device = seq_lens.device
    runner.__dict__.update(
        attn_backend=backend,
        device=device,
        capture_forward_mode=mode,
        model_runner=SimpleNamespace(
            spec_algorithm=SpeculativeAlgorithm.from_string(
                "EAGLE" if mode.is_target_verify() else "NONE"
            ),
            lora_manager=None,
        ),
        enable_pdmux=False,
        enable_two_batch_overlap=False,
        require_mlp_tp_gather=False,
        require_attn_tp_gather=False,
        is_encoder_decoder=False,
        seq_len_fill_value=FILL,
        _metadata_glue=(
            MetadataGlueGraph(device) if envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get() else None
        ),
        _skip_glued_replay_view=envs.SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW.get(),
        buffers=SimpleNamespace(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=None,
            encoder_lens=None,
            mamba_track_indices=None,
        ),
    )
    return runner


def replay_prep_arguments(runner, *, raw_bs: int, bs: int, num_tokens: int) -> tuple:
    """(forward batch, keyword arguments) of the decode runner's replay prep for a batch of
    ``raw_bs`` requests replayed at the captured ``bs`` (its buffers already filled, padded rows
    included), as ``load_batch`` builds them before it calls ``_init_replay_attn_metadata``."""
    mode = runner.capture_forward_mode
    forward_batch = SimpleNamespace(
        forward_mode=mode,
        seq_lens_sum=None,  # DSA opts out of the host sum (needs_cpu_seq_lens = False)
        seq_lens_cpu=None,
        max_seq_len_host=None,
        out_cache_loc=None,
        out_cache_loc_virtual=None,
        kv_loc_plan=None,
        kv_loc_cols=None,
        max_seq_len_override=None,
        spec_info=None,
        lora_ids=None,
        can_run_decode_cuda_graph=True,
    )
    return forward_batch, dict(
        raw_bs=raw_bs,
        bs=bs,
        num_tokens=num_tokens,
        glue_key=runner._glue_key(bs, str(mode), None),
        early_staged=False,
        attention_variant=None,
    )


class Runner:
    """One graph runner of an arm, as its attention backend sees it.

    ``op`` is one of :data:`OPS`: the target's verify runner (``TARGET_VERIFY``, its seq_lens and
    request slots the runner's static buffers; its replay prep through SGLang's
    ``DecodeCudaGraphRunner``, :func:`decode_runner`), the draft-extend runner (``DRAFT_EXTEND_V2``: the
    whole static buffers, the accept lengths in ``spec_info``), the draft-decode runner (``DECODE``
    on the multi-step backend: the caller's tensors when the batch fills the captured size, else the
    static buffers). A padded row has seq_len :data:`FILL` and slot 0, as the runners pad.

    ``forward(runner, batch)``, when given, runs in the graph after the metadata prep (a model's
    layer: ``dsa_layer``) and returns named tensors, kept in :attr:`forward_reads` per bs;
    :attr:`after_prep`, when set, is called with the bs between a replay's prep and its graph."""

    def __init__(
        self,
        op: str,
        backend,
        *,
        sizes: Sizes,
        graphs: Graphs,
        tokens: int,
        reader: bool = True,
        forward: Optional[Callable] = None,
    ):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.op, self.backend, self.graphs, self.reader = op, backend, graphs, reader
        self.tokens, self.forward = tokens, forward
        self.mode = {
            "target verify": ForwardMode.TARGET_VERIFY,
            "draft extend": ForwardMode.DRAFT_EXTEND_V2,
            "draft decode": ForwardMode.DECODE,
            DECODE: ForwardMode.DECODE,
        }[op]
        device = sizes.device
        self.seq_lens = torch.full((sizes.max_bs,), FILL, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(sizes.max_bs, dtype=torch.int64, device=device)
        self.accepted = torch.ones(sizes.max_bs, dtype=torch.int32, device=device)
        self.reads: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.forward_reads: dict[int, dict[str, torch.Tensor]] = {}
        self.after_prep: Optional[Callable[[int], None]] = None  # called with the bs, if set
        self.static: dict[int, dict[str, object]] = {}
        self._outputs: dict[str, torch.Tensor] = {}
        self.decode_runner = None
        if op in ("target verify", DECODE):
            self.decode_runner = decode_runner(
                backend,
                self.mode,
                seq_lens=self.seq_lens,
                req_pool_indices=self.req_pool_indices,
                max_tokens=sizes.max_bs * tokens,
            )

    @property
    def backends(self) -> list:
        """The DSA backends whose metadata this runner's forward reads (the step backends of the
        multi-step backend, in step order)."""
        if self.op == "draft decode":
            return list(self.backend.attn_backends)
        return [self.backend]

    def _batch(self, bs: int, seq_lens, req_pool_indices, accepted=None):
        spec_info = None
        if self.op == "draft extend":
            own = self.accepted[:bs] if accepted is None else accepted
            spec_info = SimpleNamespace(num_accept_tokens=own)
        return SimpleNamespace(
            batch_size=bs,
            forward_mode=self.mode,
            seq_lens=seq_lens,
            seq_lens_cpu=None,  # DSA needs none (needs_cpu_seq_lens = False)
            seq_lens_sum=None,  # DSA opts out of the host sum (needs_cpu_seq_lens = False)
            req_pool_indices=req_pool_indices,
            spec_info=spec_info,
            out_cache_loc=None,
            input_ids=None,
            positions=None,
            encoder_lens=None,
        )

    def capture(self, bs: int) -> None:
        """The runner's capture of ``bs``: the backend's metadata for it
        (``init_forward_metadata_out_graph(..., in_capture=True)``), then the graph."""
        self.seq_lens.fill_(FILL)
        self.req_pool_indices.zero_()
        batch = self._batch(bs, self.seq_lens[:bs], self.req_pool_indices[:bs])
        self.backend.init_forward_metadata_out_graph(batch, in_capture=True)
        reads, self.static[bs] = {}, {}
        for i, backend in enumerate(self.backends):
            tensors, static = metadata_reads(backend.decode_cuda_graph_metadata[bs])
            label = f"step {i} " if self.op == "draft decode" else ""
            reads.update({label + name: tensor for name, tensor in tensors.items()})
            self.static[bs].update({label + name: value for name, value in static.items()})
        if self.reader:
            self.reads[bs] = {name: (src, self._output(name, src)) for name, src in reads.items()}
        else:
            self.reads[bs] = {}

        written = self.forward_reads[bs] = {}

        def body():
            self.backend.init_forward_metadata_in_graph(batch)
            for src, out in self.reads[bs].values():
                out.copy_(src)
            if self.forward is not None:
                for name, value in self.forward(self, batch).items():
                    if name not in written:  # at the first warm-up, outside the capture
                        written[name] = self._output(f"forward {name}", value)
                    written[name].copy_(value)

        self.graphs.capture((self.op, bs), body)

    def _output(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A view shaped like ``src`` of the output that every batch size's graph writes ``name``
        into (sized at the first, the largest, captured batch size)."""
        out = self._outputs.get(name)
        if out is None:
            out = self._outputs[name] = torch.empty(src.numel(), dtype=src.dtype, device=src.device)
        if out.numel() < src.numel() or out.dtype != src.dtype:
            raise RuntimeError(f"{self.op}: {name} grew past the largest captured batch size")
        return out[: src.numel()].view(src.shape)

    def replay(
        self, bs: int, lengths: torch.Tensor, slots: torch.Tensor, accepted=None, in_place=None
    ) -> float:
        """One replay of the captured ``bs`` for ``lengths`` / ``slots`` (int64, the scheduler's
        tensors; fewer than ``bs`` are padded): the backend's replay metadata, then the graph.
        Returns the host microseconds of SGLang's whole ``init_forward_metadata_out_graph`` call,
        or of ``in_place()`` called in its place (after the same input copies; the metadata is
        then left as it was)."""
        raw = lengths.numel()
        padded = raw != bs
        if padded:
            self.seq_lens.fill_(FILL)
            self.req_pool_indices.zero_()
            self.accepted.fill_(1)
        self.seq_lens[:raw].copy_(lengths)
        self.req_pool_indices[:raw].copy_(slots)
        if accepted is not None:
            self.accepted[:raw].copy_(accepted)
        if self.decode_runner is not None:
            batch = self._batch(bs, self.seq_lens[:bs], self.req_pool_indices[:bs])
        elif self.op == "draft extend":  # unpadded, the round's accept lengths (SGLang's runner)
            own = None if padded or accepted is None else accepted.to(self.accepted.dtype)
            batch = self._batch(bs, self.seq_lens, self.req_pool_indices, own)
        elif padded:
            batch = self._batch(bs, self.seq_lens[:bs], self.req_pool_indices[:bs])
        else:
            batch = self._batch(bs, lengths, slots)
        if self.op == "draft decode":  # as the runner hands the multi-step backend its batch
            batch.num_padding = bs - raw
        if in_place is not None:
            start = time.perf_counter()
            in_place()
        elif self.decode_runner is None:
            start = time.perf_counter()
            self.backend.init_forward_metadata_out_graph(batch)
        else:  # what load_batch builds before the call is not the prep's
            batch, kwargs = replay_prep_arguments(
                self.decode_runner, raw_bs=raw, bs=bs, num_tokens=bs * self.tokens
            )
            start = time.perf_counter()
            self.decode_runner._init_replay_attn_metadata(batch, **kwargs)
        host_us = (time.perf_counter() - start) * 1e6
        if self.after_prep is not None:
            self.after_prep(bs)
        self.graphs.replay((self.op, bs))
        return host_us

    def read(self, bs: int) -> dict[str, torch.Tensor]:
        """What the graph of ``bs`` read at its last replay, by name."""
        return {name: out for name, (_, out) in self.reads[bs].items()}

    def poison(self, bs: int, value: int) -> None:
        """Every int32 element a replay of ``bs`` writes set to ``value`` (before both arms replay):
        what the replay leaves unwritten keeps it. Kept as captured: the query offsets
        (``cu_seqlens_q``, ``dsa_cu_seqlens_q``: 0, 1, 2, ...) and the leading 0 of the key
        offsets (``cu_seqlens_k``, ``dsa_cu_seqlens_k``), which SGLang sets at capture and never
        rewrites (its draft-decode copies write ``[1:]``)."""
        for name, (src, _) in self.reads[bs].items():
            if src.dtype != torch.int32 or name.endswith("cu_seqlens_q"):
                continue
            (src[1:] if name.endswith("cu_seqlens_k") else src).fill_(value)


def differences(on: Runner, off: Runner, bs: int, *, skip=()) -> list[tuple[str, object]]:
    """(name, differs) for every tensor the two arms' graphs of ``bs`` read, ``differs`` a bool or
    a 0-d bool tensor (on the device: read them all with one sync). Each tensor is compared whole,
    bit for bit, but the words SGLang's prep leaves unwritten (:func:`unwritten`) and
    ``real_page_table``: each row's entries that SGLang's kernels write (page ``c`` while
    ``c * page_size`` is below the row's ``cache_seqlens_int32`` rounded up to
    :data:`SGLANG_BLOCK_N` token columns), since past them a replay leaves what an earlier replay
    of any batch size wrote (SGLang's contract: readers stop at the row's length); and a plan of
    SGLang's JIT ``plan_topk_v2``, compared as its kernel defines it (:func:`plan_differs`). Names
    in ``skip``, or whose last word is, are left out."""
    ours, stock = on.read(bs), off.read(bs)
    out = []
    for name in sorted(set(ours) | set(stock)):
        if name in skip or name.rpartition(" ")[2] in skip:
            continue
        a, b = ours.get(name), stock.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out.append((name, True))
            continue
        words = compared_words(off, bs, name)
        if words is None and name.endswith("topk_v2_plan") and sglang_plan():
            out.append((name + " (plan)", plan_differs(a, b)))
        elif words is None:
            out.append((name, (a != b).any()))
        elif words is not False:
            out.append((name + " (written)", ((a != b) & words).any()))
    return out


def sglang_plan() -> bool:
    """Whether the installed ``plan_topk_v2`` is SGLang's own (not the harness's stand-in, which
    writes every word of its plan as a function of the lengths)."""
    import sglang.kernels.ops.attention.dsv4.topk as topk_v2

    return not isinstance(getattr(topk_v2.plan_topk_v2, "__self__", None), kit.StandIns)


def plan_differs(ours: torch.Tensor, stock: torch.Tensor) -> torch.Tensor:
    """Whether two plans of SGLang's top-k v2 differ as its kernel defines one (``topk_v2.cuh``,
    ``topk_plan_cluster``): row 0 the cluster threshold and the number N of items routed to the
    cluster pool, rows 1 .. N those items, (row, length), in the order the kernel's atomics
    appended them; the rows past N are not written. Compared: row 0, and each plan's N items as a
    set (a 0-d bool tensor)."""
    return (ours[0] != stock[0]).any() | (_plan_items(ours) != _plan_items(stock)).any()


def _plan_items(plan: torch.Tensor) -> torch.Tensor:
    """A plan's items by row: the length its rows 1 .. N give each row, -1 for a row not among
    them (items naming a row out of range land past the end, and are dropped)."""
    rows = plan.shape[0] - 1
    index = torch.arange(plan.shape[0], device=plan.device)
    item = (index >= 1) & (index <= plan[0, 1])
    row = plan[:, 0].to(torch.int64)
    row = torch.where(item & (row >= 0) & (row < rows), row, rows)
    items = torch.full((rows + 1,), -1, dtype=plan.dtype, device=plan.device)
    items.scatter_(0, row, torch.where(item, plan[:, 1], -1))
    return items[:rows]


def stale_steps(arm) -> range:
    """The draft steps whose indexer plans (:data:`INDEXER_PLANS`) SGLang's own replay prep of
    ``arm`` leaves as they were: with its JIT multi-step metadata copy
    (``fused_metadata_copy_multi_cuda``, which its
    ``DeepseekSparseAttnMultiStepBackend.init_forward_metadata_out_graph`` takes past three
    steps) step backends 0 to 2, whose plans that copy does not write and nothing after it
    refreshes (steps 3 and on are refreshed one by one). Where the copy is the harness's
    stand-in, which raises, SGLang's fallback refreshes every step: none."""
    import sglang.kernels.ops.attention.dsa.fused_metadata_copy as metadata_copy

    loader = metadata_copy._jit_fused_metadata_copy_multi_module
    if not arm.speculative or getattr(loader, "__module__", None) != metadata_copy.__name__:
        return range(0)
    if arm.multi.speculative_num_steps <= 3:
        return range(0)
    return range(3)


def stale_step_plans(arm) -> tuple[str, ...]:
    """The draft-decode reads that SGLang's own replay prep of ``arm`` leaves as they were: the
    indexer plans of :func:`stale_steps`."""
    return tuple(f"step {i} {name}" for i in stale_steps(arm) for name in INDEXER_PLANS)


def set_aside(off, op: str) -> tuple[str, ...]:
    """The reads of ``op`` that :func:`differences` leaves out between two arms (``off``: the
    stock :class:`Arm`): of a draft decode, the indexer plans (:data:`INDEXER_PLANS`) where its
    steps are seeded (no seeded step reads them), else those SGLang's own prep leaves as they were
    (:func:`stale_step_plans`); nothing of any other op."""
    if op != "draft decode":
        return ()
    return INDEXER_PLANS if off.seeded else stale_step_plans(off)


def compared_words(off: Runner, bs: int, name: str):
    """The words of the read tensor ``name`` that :func:`differences` compares (the stock arm
    ``off``'s read of ``bs`` decides): None for every word, False for none, else a bool mask:
    ``real_page_table`` the pages SGLang's kernels write (:func:`written_pages`), elsewhere all
    but what :func:`unwritten` names."""
    stock = off.read(bs)
    if name.endswith("real_page_table"):
        prefix = name[: -len("real_page_table")]
        return written_pages(
            stock[prefix + "cache_seqlens_int32"], stock[name], off.static[bs][prefix + "page_size"]
        )
    kept = unwritten(name, stock[name])
    if kept is None:
        return None
    if kept is True:
        return False
    return ~kept


# FlashMLA's DecodingSchedMeta: seven ints of schedule, then ``int _pad[1]``, which its
# get_mla_metadata never writes and its decode never reads.
FLASHMLA_PAD_COLUMN = 7
_plan_written: dict[tuple, bool] = {}


def unwritten(name: str, stock: torch.Tensor):
    """The words of one read tensor that SGLang's prep leaves unwritten, as they come out of the
    ``torch.empty`` its leaves return and copies into the graph's buffer (so they differ from
    arm to arm and replay to replay, and no reader looks at them): None where every word is
    written, True for the whole tensor, else a bool mask like ``stock``.

    - ``flashmla_metadata``'s ``_pad`` column (:data:`FLASHMLA_PAD_COLUMN`);
    - ``topk_v2_plan`` where the installed ``plan_topk_v2`` (SGLang's JIT kernel, or a stand-in)
      writes no plan for its row count: SGLang's kernel plans only the batches its persistent
      cluster top-k takes, and its top-k reads the plan only for those (``topk_v2.cuh``); asked
      of the installed op once per row count, the way SGLang's ``topk_v2_plan_is_written`` asks."""
    leaf = name.rpartition(" ")[2]
    if leaf == "flashmla_metadata.flashmla_metadata" and stock.shape[-1] == 8:
        mask = torch.zeros_like(stock, dtype=torch.bool)
        mask[..., FLASHMLA_PAD_COLUMN] = True
        return mask
    if leaf == "topk_v2_plan":
        import sglang.kernels.ops.attention.dsv4.topk as topk_v2

        key = (topk_v2.plan_topk_v2, stock.shape, stock.device)
        if key not in _plan_written:
            probe = torch.full_like(stock, -1)
            lengths = torch.ones(stock.shape[0] - 1, dtype=torch.int32, device=stock.device)
            topk_v2.plan_topk_v2(lengths, out=probe)
            _plan_written[key] = bool((probe != -1).any())
        return None if _plan_written[key] else True
    return None


def describe(on: Runner, off: Runner, bs: int, name: str) -> str:
    """Where one tensor the two arms' graphs of ``bs`` read differs, among the words
    :func:`differences` compares: how many words, the first one's index and both values."""
    name = name.removesuffix(" (written)").removesuffix(" (plan)")
    a, b = on.read(bs).get(name), off.read(bs).get(name)
    if a is None or b is None or a.shape != b.shape:
        shapes = [None if t is None else tuple(t.shape) for t in (a, b)]
        return f"{name}: ours {shapes[0]}, SGLang's {shapes[1]}"
    words = compared_words(off, bs, name)
    differ = (a != b) if words is None else (a != b) & words
    differ = differ.nonzero()
    if not len(differ):
        return f"{name}: equal"
    first = tuple(differ[0].tolist())
    return (
        f"{name}: {len(differ)} of {a.numel()} words differ, first at {first}: "
        f"ours {a[first].item()}, SGLang's {b[first].item()}"
    )


def written_pages(kv_lens: torch.Tensor, table: torch.Tensor, page_size: int) -> torch.Tensor:
    """The entries of a ``real_page_table`` (rows: the requests' rows, each request's alike) that
    SGLang's replay-metadata kernels write for requests of ``kv_lens`` tokens: page ``c`` of a row
    while ``c * page_size < SGLANG_BLOCK_N * cdiv(kv_len, SGLANG_BLOCK_N)``."""
    rows = table.shape[0]
    kv = kv_lens.repeat_interleave(rows // kv_lens.numel()).to(torch.int64)
    end = (kv + SGLANG_BLOCK_N - 1) // SGLANG_BLOCK_N * SGLANG_BLOCK_N
    return torch.arange(table.shape[1], device=table.device)[None, :] * page_size < end[:, None]


def static_differences(on: Runner, off: Runner, bs: int) -> list[str]:
    """The host-side metadata fields of ``bs`` that differ between the arms."""
    a, b = on.static[bs], off.static[bs]
    return [name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


@dataclasses.dataclass
class Memory:
    """``torch.cuda.memory_allocated`` (bytes) at each stage of an arm's build, and its graph pool."""

    before: int = 0
    graph_state: int = 0  # after every backend's init_cuda_graph_state
    captured: int = 0  # after every batch size's capture (metadata and graphs)
    pool: Optional[int] = None  # the arm's graph pool after capture


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class Arm:
    """The DSA backends of one server with the kill switches at ``env``: the target (SGLang's
    attention registry), the draft-extend and the multi-step backends (its ``DraftBackendFactory``,
    ``seeded``: the draft's top-k from draft extend), their graph state, and one :class:`Runner` per
    op; in a server without speculative decoding (:func:`launch` of None), the target alone and its
    :data:`DECODE` runner. ``kernels``: SGLang's replay-metadata kernels the backends pick up
    (:func:`sglang_metadata_kernels`), None for those SGLang imported. Without ``reader`` the graphs
    hold the runners' ``init_forward_metadata_in_graph`` alone (no outputs of the harness's own: for
    measuring memory)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        *,
        sizes: Sizes,
        tokens: int,
        req_to_token: torch.Tensor,
        seeded: bool,
        kernels: Optional[dict] = None,
        reader: bool = True,
        pool=None,
        forward: Optional[Callable] = None,
    ):
        import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager
        from sglang.srt.runtime_context import get_spec

        self.name, self.env, self.sizes, self.seeded = name, env, sizes, seeded
        self.tokens, self.kernels, self.reader = tokens, kernels or {}, reader
        self.forward = forward
        self.speculative = bool(get_spec().speculative_num_draft_tokens)
        self.graphs = Graphs(sizes.device)
        self.memory = Memory(before=allocated(sizes.device))
        common = dict(
            context_len=sizes.context,
            page_size=sizes.page_size,
            req_to_token=req_to_token,
            device=sizes.device,
            hf_config=kit.glm5_config(index_topk=sizes.index_topk),
            token_to_kv_pool=pool,
        )
        with switches(env), swapped(manager, self.kernels):
            self.target = kit.target_backend(kit.model_runner(**common))
            self.extend = self.multi = None
            if self.speculative:
                self.extend, self.multi = kit.draft_backends(
                    kit.model_runner(is_draft=True, **common), seeded=seeded
                )
            self._graph_state()
            self.memory.graph_state = allocated(sizes.device)
            self.runners = self._runners()

    def _graph_state(self) -> None:
        """Each backend's ``init_cuda_graph_state`` (its metadata buffers allocated anew), as the
        constructors of SGLang's graph runners call it."""
        max_bs, tokens = self.sizes.max_bs, self.tokens
        self.target.init_cuda_graph_state(max_bs, max_bs * tokens)
        if self.speculative:
            self.multi.init_cuda_graph_state(max_bs, max_bs)
            self.extend.init_cuda_graph_state(max_bs, max_bs * tokens)

    def _runners(self) -> dict[str, Runner]:
        """A :class:`Runner` per op over its backend, with static input buffers of its own, its
        graphs in :attr:`graphs`."""
        backends = {DECODE: self.target}
        if self.speculative:
            backends = {"target verify": self.target, "draft decode": self.multi}
            backends["draft extend"] = self.extend
        return {
            op: Runner(
                op,
                backend,
                sizes=self.sizes,
                graphs=self.graphs,
                tokens=self.tokens,
                reader=self.reader,
                forward=self.forward,
            )
            for op, backend in backends.items()
        }

    def recapture(self, batch_sizes) -> None:
        """SGLang's recapture while serving (a weight update with ``recapture_cuda_graph``,
        elastic EP's scale-up: ``init_decode_cuda_graph`` builds a new graph runner): new runners
        over the same backends, each backend's ``init_cuda_graph_state`` called again, then every
        batch size captured again (:meth:`capture`) in new graphs. The runners, graphs and graph
        state of before are let go only after that, so that no buffer of the new ones takes an
        address that a graph captured before reads or writes: a graph left from before that still
        runs then writes nothing the new graphs read."""
        import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager

        state = [backend.decode_cuda_graph_metadata for backend in self.backends().values()]
        before = self.runners, self.graphs, state
        self.graphs = Graphs(self.sizes.device)
        with switches(self.env), swapped(manager, self.kernels):
            self._graph_state()
            self.runners = self._runners()
        self.capture(batch_sizes)
        del before

    def capture(self, batch_sizes) -> None:
        """Every runner captures every batch size, the largest first (SGLang's order: the target's
        runner, then the draft decode's, then the draft extend's)."""
        with switches(self.env), self.graphs.capturing():
            for runner in self.runners.values():
                for bs in sorted(batch_sizes, reverse=True):
                    runner.capture(bs)
        self.memory.captured = allocated(self.sizes.device)
        self.memory.pool = self.graphs.pool_bytes()

    def replay(self, op: str, bs: int, lengths, slots, accepted=None, in_place=None) -> float:
        with switches(self.env):
            return self.runners[op].replay(bs, lengths, slots, accepted, in_place)

    def step_backends(self) -> list:
        return list(self.multi.attn_backends) if self.speculative else []

    def backends(self) -> dict:
        """Every DSA backend of the arm, by role."""
        if not self.speculative:
            return {"target": self.target}
        out = {"target": self.target, "draft extend": self.extend}
        out.update({f"draft step {i}": b for i, b in enumerate(self.step_backends())})
        return out

    def graph_state_bytes(self) -> int:
        """Bytes of the distinct tensors the arm's backends' graph state holds
        (``dsa_backends.graph_state_bytes``), the same count the meta-device computation makes."""
        return sum(kit.graph_state_bytes(backend) for backend in self.backends().values())


def request_tensor(values, device: torch.device, *, odd: bool = False) -> torch.Tensor:
    """int64 ``values`` on ``device`` as the scheduler hands them, or (``odd``) as a view one element
    into a larger tensor: an input at an address that is not 16-byte aligned."""
    if not odd:
        return torch.tensor(list(values), dtype=torch.int64, device=device)
    return torch.tensor([0, *values], dtype=torch.int64, device=device)[1:]


def verify_input(backend, seq_lens, req_pool_indices, req_to_token, *, steps: int, seed: int = 0):
    """SGLang's ``build_eagle_verify_input`` for a topk=1 chain draft of these requests (int64
    tensors on the target's device), against the target ``backend``: its verify mask decides the
    path (none: SGLang's FULL_MASK tree build; the plugin's QLEN_ONLY mask: SGLang's fused chain
    tree, which also prepares the verify cache locations). Returns the ``EagleVerifyInput`` and the
    verify cache locations (``prepared_out_cache_loc``, or what SGLang's
    ``eagle_prepare_for_verify`` assigns on the FULL_MASK path:
    ``assign_extend_cache_locs_uniform_func``)."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform_func
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase
    from sglang.srt.speculative.eagle_utils import default_tree_mask_mode
    from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input

    device = seq_lens.device
    tokens = steps + 1
    bs = seq_lens.numel()
    worker = SimpleNamespace(
        topk=1,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=tokens,
        device=device,
        server_args=None,
    )
    EagleDraftWorkerBase._rebuild_topk1_chain_buffers(worker)
    generator = torch.Generator().manual_seed(seed)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        seq_lens=seq_lens,
        seq_lens_sum=None,  # DSA: needs_cpu_seq_lens = False
        req_pool_indices=req_pool_indices,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        multimodal_inputs=[None] * bs,
    )
    bonus = torch.randint(0, 154880, (bs,), generator=generator).to(device)
    draft_tokens = torch.randint(0, 154880, (bs, steps), generator=generator).to(device)
    target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            attn_backend=backend, model_config=SimpleNamespace(model_is_mrope=False)
        )
    )
    verify = build_eagle_verify_input(
        batch,
        SimpleNamespace(bonus_tokens=bonus),
        worker._topk1_parents_prealloc[:bs],
        worker._topk1_score_indices_prealloc[:bs],
        draft_tokens,
        None,
        target_worker=target_worker,
        topk=1,
        num_steps=steps,
        num_draft_tokens=tokens,
        tree_mask_mode=default_tree_mask_mode(),
        device=str(device),
    )
    cache_loc = verify.prepared_out_cache_loc
    if cache_loc is None:
        cache_loc = assign_extend_cache_locs_uniform_func(
            req_pool_indices=req_pool_indices,
            req_to_token=req_to_token,
            start_offset=seq_lens,
            batch_size=bs,
            draft_token_num=tokens,
            device=device,
        )
    return verify, cache_loc


def triton_tree_builder(monkeypatch) -> None:
    """SGLang's CUDA tree builder (a JIT build) replaced by its Triton builder, the same tree, and
    its verify cache locations by its Triton kernel (on CUDA SGLang's own choice): SGLang's XPU
    branches of ``build_tree_kernel_efficient_func`` and ``assign_extend_cache_locs_uniform_func``.
    """
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.kernels.ops.speculative.spec_tree as spec_tree

    monkeypatch.setattr(spec_tree, "_is_xpu", True)
    monkeypatch.setattr(cache_locs, "_is_xpu", True)
