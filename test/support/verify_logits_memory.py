"""The target model's logits tail in target-verify CUDA graphs, captured as SGLang 0.5.23's
target-verify graph runner captures it, with the target-verify exchange on and off: the memory the
captured graphs keep.

SGLang's runner captures one graph per batch size of its capture list, largest first, into one
shared graph pool, hands every graph a row prefix of one fp32 logits buffer that all graphs share
(``GraphSharedOutput.get_logits_buffer``) and keeps each graph's output (its full graph backend's
``_outputs``). The body here is the target's ``LogitsProcessor.forward`` in target verify on a
static hidden-state buffer (SGLang's constructors: :func:`deployment.build_lm_head`, the plugin's
hooks as SGLang's loader applied them). The arms (:data:`ARMS`):

- ``off``: SGLang's path (the LM-head matmul, then its cast into the buffer; at TP > 1 the gather
  between them);
- ``on``: the exchange as it ships (the shard and the tokens kept inside the shared buffer);
- ``per-graph shard``: the positive control, the exchange as it first shipped: the shard kept is
  the LM head's output allocated inside each capture, which every graph's kept output holds.

One GPU runs TP 1 only: a TP-8 rank's shard width is emulated by a TP-1 model whose vocabulary is
that width (GLM-5: 19,360 columns), so its LM-head matmul, kept shard and partials are a TP-8
rank's, but it gathers nothing and its logits buffer has 19,360 columns, not 154,880.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dsa_mtp.switches import VERIFY_ARGMAX_EXCHANGE
from support import dsa_serving
from support.deployment import build_lm_head, logits_forward
from support.dsa_backends import LAUNCHES
from support.dsa_serving import Graphs, allocated
from support.tp import free_port, sglang_parallel_groups

GLM5_VOCAB, GLM5_HIDDEN = 154880, 6144
TP8_SHARD = GLM5_VOCAB // 8  # 19,360
ARMS = ("off", "on", "per-graph shard")
MAX_BS = (48, 256)  # SGLang's spec-mode default, and --cuda-graph-max-bs 256
LAUNCH = "3/1/4"  # EAGLE 3/1/4: 4 verify rows per request, the same in every request
# The widths measured: a TP-8 rank's GLM-5 shard (emulated, see above) and the whole GLM-5 vocab.
GPU_WIDTHS = {"TP 8 width": TP8_SHARD, "TP 1": GLM5_VOCAB}
CPU_WIDTHS = {"TP 8 width": 128, "TP 1": 1024}  # the dry run's


@dataclass(frozen=True)
class Case:
    """One measurement: the vocabulary the TP-1 model has (a TP-8 shard width, or the whole), the
    hidden size, the verify rows per request and the captured batch sizes (SGLang's list)."""

    vocab: int
    hidden: int
    tokens: int
    captured: tuple[int, ...]

    @property
    def max_rows(self) -> int:
        return max(self.captured) * self.tokens


def cases(max_bs: int, device: torch.device) -> dict[str, Case]:
    """The cases of one ``--cuda-graph-max-bs``, by width label: GLM-5's hidden size and widths on
    a GPU (the dry run's at 64 and :data:`CPU_WIDTHS`), SGLang's capture list for it."""
    cuda = device.type == "cuda"
    base = dsa_serving.GPU_SIZES if cuda else dsa_serving.cpu_sizes(max_bs)
    sizes = dataclasses.replace(base, device=device, max_bs=max_bs, pool=2 * max_bs + 1)
    with dsa_serving.launch(LAUNCH, sizes) as (_, captured):
        tokens = LAUNCHES[LAUNCH][2]
    hidden = GLM5_HIDDEN if cuda else 64
    widths = GPU_WIDTHS if cuda else CPU_WIDTHS
    return {label: Case(width, hidden, tokens, tuple(captured)) for label, width in widths.items()}


@dataclass
class Figures:
    """One arm's bytes: ``memory_allocated`` after capture beyond before it, the graph pool's
    segments after capture and the peak beyond before capture (None off a GPU)."""

    captured: int = 0
    pool: Optional[int] = None
    peak: Optional[int] = None


def _kept_per_graph(exchange, shard, buffer):
    """The shard and its tokens as the exchange first kept them: the LM head's own output and a
    tokens tensor, both allocated in the call (in a capture: in the graph pool, per graph)."""
    return shard, torch.empty((shard.shape[0], 1), dtype=torch.int64, device=shard.device)


@contextlib.contextmanager
def _arm(monkeypatch, arm: str):
    """The plugin's switch for ``arm``, and for the control the shard returned as it was kept
    first (the LM head's own output, allocated in the capture)."""
    from sglang_dsa_mtp.integration import vocab_shard_exchange as site

    with monkeypatch.context() as patch:
        patch.setenv(VERIFY_ARGMAX_EXCHANGE.env, "0" if arm == "off" else "1")
        if arm == "per-graph shard":
            patch.setattr(site.VocabShardExchange, "keep_in_buffer", _kept_per_graph)
        yield site


def measure(case: Case, arm: str, device: torch.device, monkeypatch) -> Figures:
    """Build the target's LM head and processor, opt it in as SGLang's EAGLE worker does (the
    ``on`` arms), then capture every batch size of ``case`` largest first into one pool, keeping
    every graph's output; inside an SGLang TP group of one rank."""
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput

    with _arm(monkeypatch, arm) as site:
        lm_head, processor, _ = build_lm_head(
            case.vocab, case.hidden, dtype=torch.bfloat16, seed=0, device=device
        )
        if arm != "off":
            rows = [bs * case.tokens for bs in case.captured]
            decision = site.opt_in(
                processor, lm_head, site.VERIFY, max_rows=case.max_rows, capture_rows=rows
            )
            if not decision.engaged:
                raise RuntimeError(f"the exchange did not engage: {decision.reason}")
        shared = GraphSharedOutput(device=device, max_rows=case.max_rows)
        buffer = shared.get_logits_buffer(case.vocab, rows=case.max_rows)
        hidden = torch.zeros(case.max_rows, case.hidden, dtype=torch.bfloat16, device=device)
        graphs, outputs = Graphs(device), {}
        settle(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = allocated(device)
        with graphs.capturing():
            for bs in sorted(case.captured, reverse=True):
                rows = bs * case.tokens

                def body(rows=rows, bs=bs):
                    outputs[bs] = logits_forward(
                        processor,
                        lm_head,
                        hidden[:rows],
                        mode="target_verify",
                        logits_buffer=buffer[:rows],
                    )

                graphs.capture(bs, body)
        figures = Figures(captured=allocated(device) - before, pool=graphs.pool_bytes())
        if device.type == "cuda":
            figures.peak = torch.cuda.max_memory_allocated() - before
    return figures  # the graphs, their outputs and the buffers go with this frame


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """SGLang's TP group of this one process (NCCL on a GPU, gloo on the CPU)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with sglang_parallel_groups(0, 1, f"tcp://127.0.0.1:{free_port()}", backend=backend) as group:
        yield group


def measure_case(case: Case, device: torch.device, monkeypatch) -> dict[str, Figures]:
    """Every arm of ``case``, each built alone (the device's cache emptied between arms), in
    :func:`one_rank_group`."""
    figures = {}
    with one_rank_group(device):
        for arm in ARMS:
            settle(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            figures[arm] = measure(case, arm, device, monkeypatch)
    return figures


def settle(device: torch.device) -> None:
    """Free what earlier arms left to the garbage collector (their graphs sit in reference
    cycles), so that no free of theirs lands inside a later arm's measurement."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def retained_beyond_stock(figures: dict[str, Figures], arm: str) -> int:
    """Bytes ``arm``'s captured graphs keep allocated beyond SGLang's own (``off``)."""
    return figures[arm].captured - figures["off"].captured
