"""One DSA attention layer on the serving slice (``dsa_serving``): SGLang's own attention forward
in the graphs of both arms, reading the metadata each arm's replay prep wrote, compared bit for bit.

Each runner's captured graph is SGLang's ``init_forward_metadata_in_graph`` followed by the layer's
attention, as a model's forward runs it after its projections (:meth:`Layer.forward`): the
backend's ``get_indexer_metadata``, SGLang's ``Indexer._get_topk_paged`` (the paged-MQA logits,
then the top-k SGLang's top-k backend picks, with the transform to token locations), then the
backend's ``forward_decode`` (decode, draft decode) or ``forward_extend`` (target verify) with those
indices, on one ``RadixAttention`` layer. Both run in SGLang's forward context, over one real
``DSATokenToKVPool`` (FlashMLA's fp8 KV layout, written by the pool's own ``set_mla_kv_buffer``;
the index keys random fp8 with scales) that both arms share, as they share ``req_to_token``: each
request slot's row maps its token columns onto pages of its own, in a random order. The graphs
write the layer's top-k indices and attention output into outputs that outlive them; after a
replay of each arm, :func:`differences` compares them whole, but those of the draft steps whose
indexer plans SGLang's own prep leaves as they were (``dsa_serving.stale_steps``).

What is not SGLang's on a GPU, and why:

- the queries (the absorbed ``q_nope`` and ``q_rope`` of the attention, the indexer's fp8
  queries and head weights): seeded random, as the model's projections would hand them;
  the new tokens' keys are not stored (``k=None``: the pool holds every token already);
- DeepGEMM's paged-MQA logits: SGLang's torch logits (``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1``,
  SGLang's own switch, ``dsa_backends.torch_logits``), since SGLang 0.5.23's DeepGEMM does not load on torch 2.11
  (``real_ops.import_deep_gemm`` names why); the torch logits ignore DeepGEMM's schedule, and
  read a row's pages below its length only, as DeepGEMM does (``dsa_backends.live_pages``: SGLang's
  torch function gathers every entry of the table, where a replay prep leaves past the length what
  an earlier replay left, which on a GPU named no page of the pool: a device-side assertion);
- the rotary embedding the indexer's constructor builds (which ``_get_topk_paged`` does not use):
  an identity.

The rest is SGLang's: the top-k (its JIT ``topk_transform_paged_v2`` with its plan, the fused
default), FlashMLA's metadata and sparse decode (``flash_mla_with_kvcache`` on the fp8 cache), the
metadata copies, and the replay-metadata kernels on the arm with the plugin off. One thing is added:
each row's top-k is sorted before the attention, so that the layer's output is a function of the
set of tokens each row selects. On a GPU the two arms' top-k and output differed in 7 of 16
plain-decode rounds and 10 of 16 target-verify rounds with every metadata word equal: SGLang's
JIT top-k reserves each selected index's output slot with an ``atomicAdd`` (``topk_v2.cuh``), so
a row's set most likely came out in orders that differ, and FlashMLA's rounding follows the order;
a difference of the sets still fails the comparison, and the reads that differ in order alone are
counted (:attr:`Report.reordered`).

Off a GPU, besides (:func:`cpu_stand_ins`): SGLang's JIT top-k and ``concat_mla_absorb_q_general``
and FlashMLA's sparse decode, as deterministic torch functions of every input they read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import types
from typing import Optional

import torch

from support import dsa_backends as kit
from support import dsa_serving
from support.constants import SMS

LAYER_ID = 0  # the layer of kit.sglang_indexer
# SGLang's FlashMLA interface module (it loads FlashMLA's CUDA library at import).
FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"
# The layer's top-k as SGLang's top-k wrote it, before each row is sorted: reported, not compared.
HANDED = "top-k as handed"


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The layer's per-row inputs, for up to ``rows`` rows (a runner's largest batch)."""

    q_nope: torch.Tensor  # [rows, heads, kv_lora_rank] bf16 (absorbed)
    q_rope: torch.Tensor  # [rows, heads, rope] bf16
    index_q: torch.Tensor  # [rows, index heads, 128] fp8
    index_weights: torch.Tensor  # [rows, index heads, 1] float32


class Layer:
    """One DSA attention layer of the model the slice's backends are built for (``hf_config``):
    its KV pool, its indexer, its ``RadixAttention``, its inputs for up to ``rows`` rows.

    ``req_to_token`` ([slots, width] int32, zeros) is filled: slot 0 (SGLang's padding slot) maps
    every column to token 0, every other slot its columns to pages of its own, in a random order of
    all the pool's pages past page 0."""

    def __init__(
        self,
        hf_config,
        req_to_token: torch.Tensor,
        *,
        rows: int,
        generator: torch.Generator,
        page_size: int = 64,
    ):
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        device = req_to_token.device
        self.device, self.config = device, hf_config
        slots, width = req_to_token.shape
        pages_per_slot = -(-width // page_size)
        pages = (slots - 1) * pages_per_slot + 1
        with kit.serving(None):
            self.pool = DSATokenToKVPool(
                size=pages * page_size,
                page_size=page_size,
                kv_lora_rank=hf_config.kv_lora_rank,
                dtype=torch.float8_e4m3fn,
                qk_rope_head_dim=hf_config.qk_rope_head_dim,
                layer_num=1,
                device=str(device),
                index_head_dim=hf_config.index_head_dim,
                enable_memory_saver=False,
                kv_cache_dim=656,  # FlashMLA's fp8 layout: 512 fp8, 4 float32 scales, 64 bf16
            )
            heads = hf_config.num_attention_heads
            self.attention = RadixAttention(
                num_heads=heads,
                head_dim=hf_config.kv_lora_rank + hf_config.qk_rope_head_dim,
                scaling=(hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5,
                num_kv_heads=1,
                layer_id=LAYER_ID,
                v_head_dim=hf_config.kv_lora_rank,
            )
        self.indexer = kit.sglang_indexer(hf_config, device)
        if device.type != "cuda":
            self.indexer.sm_count = SMS  # SGLang sets it on CUDA only (the stand-ins' count)
        cpu = torch.Generator().manual_seed(generator.initial_seed())
        order = torch.randperm(pages - 1, generator=cpu) + 1
        random = torch.Generator(device).manual_seed(generator.initial_seed())
        columns = torch.arange(pages_per_slot * page_size)
        for slot in range(1, slots):
            owned = order[(slot - 1) * pages_per_slot : slot * pages_per_slot]
            tokens = owned.repeat_interleave(page_size) * page_size + columns % page_size
            req_to_token[slot].copy_(tokens[:width].to(torch.int32))
        self._fill(pages * page_size, random)
        self.inputs = self._inputs(rows, random)

    def _fill(self, tokens: int, random: torch.Generator, chunk: int = 1 << 16) -> None:
        """Every token's latent key written by the pool's own ``set_mla_kv_buffer`` (its fp8
        quantization); every page's index keys random fp8 values with scales in [0.5, 1.5)."""
        config = self.config
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            nope = torch.randn(
                end - start, 1, config.kv_lora_rank, generator=random, device=self.device
            )
            rope = torch.randn(
                end - start, 1, config.qk_rope_head_dim, generator=random, device=self.device
            )
            self.pool.set_mla_kv_buffer(
                self.attention,
                torch.arange(start, end, device=self.device),
                nope.to(torch.bfloat16),
                rope.to(torch.bfloat16),
            )
        index_k = self.pool.get_index_k_with_scale_buffer(layer_id=LAYER_ID)
        head_dim = self.config.index_head_dim
        page_bytes = index_k.shape[1] // (head_dim + 4)
        values = torch.randn(
            index_k.shape[0], page_bytes * head_dim, generator=random, device=self.device
        )
        scales = (
            torch.rand(index_k.shape[0], page_bytes, generator=random, device=self.device) + 0.5
        )
        index_k.copy_(
            torch.cat(
                [values.to(torch.float8_e4m3fn).view(torch.uint8), scales.view(torch.uint8)], 1
            )
        )

    def _inputs(self, rows: int, random: torch.Generator) -> Inputs:
        config, device = self.config, self.device
        heads, index_heads = config.num_attention_heads, config.index_n_heads

        def randn(*shape, dtype=torch.bfloat16):
            return torch.randn(*shape, generator=random, device=device).to(dtype)

        return Inputs(
            q_nope=randn(rows, heads, config.kv_lora_rank),
            q_rope=randn(rows, heads, config.qk_rope_head_dim),
            index_q=randn(rows, index_heads, config.index_head_dim, dtype=torch.float8_e4m3fn),
            index_weights=randn(rows, index_heads, 1, dtype=torch.float32),
        )

    def forward(self, backend, batch, rows: int) -> dict[str, torch.Tensor]:
        """The layer's attention for the ``rows`` query rows of ``batch`` on ``backend`` (its
        forward metadata already prepared): {"top-k": the indexer's token indices, each row
        sorted, :data:`HANDED`: the same in the order SGLang's top-k wrote them, "output": the
        attention output}."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        inputs = self.inputs
        with kit.torch_logits(), forward_context(ForwardContext(attn_backend=backend)):
            metadata = backend.get_indexer_metadata(LAYER_ID, batch)
            topk = self.indexer._get_topk_paged(
                batch,
                LAYER_ID,
                inputs.index_q[:rows],
                inputs.index_weights[:rows],
                metadata,
            )
            # Each row's indices in one order (descending: the -1s last, as SGLang pads them):
            # SGLang's JIT top-k need not hand a row's set in a fixed order, and the attention's
            # rounding follows the order.
            handed, topk = topk, topk.sort(dim=-1, descending=True).values
            attend = (
                backend.forward_decode if batch.forward_mode.is_decode() else backend.forward_extend
            )
            output = attend(
                inputs.q_nope[:rows],
                None,
                None,
                self.attention,
                batch,
                save_kv_cache=False,
                q_rope=inputs.q_rope[:rows],
                topk_indices=topk,
            )
        return {"top-k": topk, HANDED: handed, "output": output}


def runner_forward(layer: Layer):
    """The forward a :class:`dsa_serving.Runner`'s graph runs after its metadata prep, for the ops
    of :data:`LAYER_OPS`: the layer on each backend the runner's forward reads (every step backend
    of a draft decode, its outputs named ``"step i top-k"`` and so on)."""

    def forward(runner, batch) -> dict[str, torch.Tensor]:
        if runner.op not in LAYER_OPS:
            return {}
        rows = batch.batch_size * (runner.tokens if runner.op == "target verify" else 1)
        out = {}
        for i, backend in enumerate(runner.backends):
            label = f"step {i} " if runner.op == "draft decode" else ""
            for name, value in layer.forward(backend, batch, rows).items():
                out[label + name] = value
        return out

    return forward


def differences(on, off, bs: int, *, stale: range = range(0)) -> list[tuple[str, object]]:
    """(name, differs) for every output of the layer the two arms' graphs of ``bs`` wrote,
    compared bit for bit (``differs`` a 0-d bool tensor, or True where the shapes differ), but the
    outputs of the draft steps in ``stale``, whose indexer plans the stock arm's prep leaves as
    they were (``dsa_serving.stale_steps``): their top-k reads those plans."""
    ours, stock = on.forward_reads[bs], off.forward_reads[bs]
    left_out = tuple(f"step {i} " for i in stale)
    out = []
    for name in sorted(set(ours) | set(stock)):
        if name.startswith(left_out) or name.endswith(HANDED):
            continue
        a, b = ours.get(name), stock.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out.append((name, True))
            continue
        out.append((name, (_bits(a) != _bits(b)).any()))
    return out


def reordered(on, off, bs: int, compared: list[tuple[str, object]]) -> int:
    """How many of the two arms' top-k reads of ``bs`` that :func:`differences` ``compared`` equal
    came out of SGLang's top-k in different orders: the differences the sort leaves out, counted
    to be reported."""
    ours, stock = on.forward_reads[bs], off.forward_reads[bs]
    count = 0
    for name, differs in compared:
        if name.endswith("top-k") and not bool(differs):
            handed = name.removesuffix("top-k") + HANDED
            count += bool((ours[handed] != stock[handed]).any())
    return count


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s words as integers (NaN compared by its bits)."""
    if tensor.is_floating_point():
        return tensor.view({2: torch.int16, 4: torch.int32, 1: torch.uint8}[tensor.element_size()])
    return tensor


def cpu_stand_ins(monkeypatch) -> None:
    """Off a GPU: SGLang's JIT top-k (:func:`paged_topk_stand_in`) and
    ``concat_mla_absorb_q_general``, and FlashMLA's sparse decode (:func:`sparse_decode_stand_in`),
    as torch functions of every input they read."""
    import sglang.kernels.ops.attention.dsv4.topk as topk_v2
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    monkeypatch.setattr(
        dsa_backend, "concat_mla_absorb_q_general", lambda a, b: torch.cat([a, b], dim=-1)
    )
    # The backend imports the interface inside its function: it finds this one.
    interface = types.ModuleType(FLASH_MLA_INTERFACE)
    interface.flash_mla_with_kvcache = sparse_decode_stand_in
    monkeypatch.setitem(sys.modules, FLASH_MLA_INTERFACE, interface)
    monkeypatch.setattr(topk_v2, "topk_transform_paged_v2", paged_topk_stand_in)


def paged_topk_stand_in(scores, seq_lens, page_tables, out_page_indices, page_size, metadata):
    """SGLang's JIT ``topk_transform_paged_v2`` on the CPU: each row's top-k of its first
    ``seq_lens`` scores (``torch.topk``), mapped through its page-table row to token locations,
    -1 past the row's length; the plan ``metadata`` must have a row per score row and one more."""
    rows, topk = out_page_indices.shape
    if metadata.shape[0] != rows + 1:
        raise ValueError(f"metadata: {metadata.shape[0]} plan rows for {rows} score rows")
    columns = torch.arange(scores.shape[1])
    lengths = seq_lens.reshape(rows, 1).long()
    masked = scores.masked_fill(columns[None, :] >= lengths, float("-inf"))
    k = min(topk, scores.shape[1])
    picked = masked.topk(k, dim=1).indices
    pages = torch.gather(page_tables.long(), 1, picked // page_size)
    tokens = torch.where(picked < lengths, pages * page_size + picked % page_size, -1)
    out_page_indices.fill_(-1)
    out_page_indices[:, :k] = tokens.to(torch.int32)


def sparse_decode_stand_in(
    *,
    q,
    k_cache,
    cache_seqlens,
    head_dim_v,
    tile_scheduler_metadata,
    num_splits,
    softmax_scale,
    indices,
    block_table,
    is_fp8_kvcache,
    kv_format=None,
):
    """FlashMLA's ``flash_mla_with_kvcache`` on the CPU: for each query row, the float sum of the
    cache bytes at its first ``cache_seqlens`` valid indices, times the row's query, plus the
    tile schedule's sum and the row's split count (every input the real kernel reads, so that a
    metadata difference reaching it changes the output)."""
    rows = q.shape[0]
    flat = k_cache.reshape(-1, k_cache.shape[-1]).view(torch.uint8).float()
    picked = indices.reshape(rows, -1).long()
    kept = (picked >= 0) & (torch.arange(picked.shape[1])[None, :] < cache_seqlens.reshape(rows, 1))
    keys = (flat[picked.clamp(min=0)] * kept[..., None]).sum(dim=(1, 2))
    schedule = tile_scheduler_metadata.float().sum() + num_splits[:rows].float()
    out = q[..., :head_dim_v].float() * softmax_scale * (keys + schedule)[:, None, None, None]
    return out.to(torch.bfloat16), None


# The ops whose runners run the layer: the target's verify and the draft's decode steps of an EAGLE
# server, the decode of a server without speculative decoding (the draft extend's graphs hold its
# metadata prep alone).
LAYER_OPS = ("target verify", "draft decode", dsa_serving.DECODE)
# Prefix lengths of the rounds: page and 128-column edges, the index top-k's, then random.
EDGES = (1, 2, 63, 64, 65, 127, 128, 129)


@dataclasses.dataclass
class Report:
    """What a run of the layer saw."""

    name: str
    captured: list[int]
    replays: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    comparisons: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    ours: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ours_off: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lengths: list[int] = dataclasses.field(default_factory=list)
    selected: int = 0  # top-k entries naming a token, over the plugin-on arm's replays
    reordered: int = 0  # top-k reads equal sorted, in another order as SGLang's top-k wrote them
    finite: bool = True  # every attention output of the plugin-on arm finite


def run(
    monkeypatch,
    sizes: dsa_serving.Sizes,
    launch: Optional[str],
    rounds: int,
    *,
    seed: int = 0,
    glue: bool = False,
    corrupt=None,
) -> Report:
    """``rounds`` rounds of the layer on both arms of one server (``launch``: an EAGLE launch of
    ``dsa_backends.LAUNCHES``, its draft's top-k its own (unseeded); None: no speculative
    decoding), the plugin-on arm's replay prep through the metadata glue where ``glue`` says: each
    round a random captured bs, the batch padded one round in two, prefixes from :data:`EDGES`,
    the index top-k and random up to the context; every op of :data:`LAYER_OPS` the server has
    replayed on the plugin-on arm, then the off arm, and the layer's outputs compared, with the
    metadata the graphs read (``dsa_serving.differences``). Our launches are counted per op
    (``serving_loop.Calls``) on each arm. ``corrupt(runner, bs)``, when given, is called after
    the plugin-on arm's replay prep and before its graph replays (``Runner.after_prep``: a planted
    difference)."""
    import random

    from support.serving_loop import Calls

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    tokens = kit.LAUNCHES[launch][2] if launch else 1
    with dsa_serving.launch(launch, sizes) as (_, captured):
        width = sizes.context + 4 + (tokens if launch else 0)
        req_to_token = torch.zeros(sizes.pool, width, dtype=torch.int32, device=sizes.device)
        layer = Layer(
            kit.glm5_config(index_topk=sizes.index_topk),
            req_to_token,
            rows=sizes.max_bs * tokens,
            generator=gen,
        )
        forward = runner_forward(layer)
        common = dict(
            sizes=sizes,
            tokens=tokens,
            req_to_token=req_to_token,
            seeded=False,
            pool=layer.pool,
            forward=forward,
        )
        on_env = {**dsa_serving.ON, dsa_serving.GLUE_ENV: "1" if glue else "0"}
        on = dsa_serving.Arm("plugin on", on_env, **common)
        off = dsa_serving.Arm(
            "plugin off",
            dsa_serving.OFF,
            kernels=dsa_serving.sglang_metadata_kernels(sizes.device),
            **common,
        )
        calls = Calls(monkeypatch)
        for arm in (on, off):
            calls.attach(arm)
            arm.capture(captured)
        if corrupt is not None:
            for runner in on.runners.values():
                runner.after_prep = functools.partial(corrupt, runner)
        report = Report(
            name=f"EAGLE {launch}, unseeded" if launch else "no speculative decoding",
            captured=list(captured),
        )
        ops = [op for op in LAYER_OPS if op in on.runners]
        for index in range(rounds):
            bs = rng.choice(captured)
            raw = bs if bs == 1 or index % 2 == 0 else rng.randint(1, bs - 1)
            slots = rng.sample(range(1, sizes.pool), raw)
            top = sizes.context - tokens - 1
            lengths = [rng.choice([*EDGES, sizes.index_topk, rng.randint(1, top)]) for _ in slots]
            lengths = [min(n, top) for n in lengths]
            report.lengths += lengths
            lengths_t = torch.tensor(lengths, dtype=torch.int64, device=sizes.device)
            slots_t = torch.tensor(slots, dtype=torch.int64, device=sizes.device)
            flags = []
            for op in ops:
                for arm, counted in ((on, report.ours), (off, report.ours_off)):
                    with calls.replay("on" if arm is on else "off") as (ran, _):
                        arm.replay(op, bs, lengths_t, slots_t)
                    counted[op] += sum(ran.values())
                report.replays[op] += 1
                for name, value in on.runners[op].forward_reads[bs].items():
                    if name.endswith("top-k"):
                        report.selected += int((value >= 0).sum())
                    elif name.endswith("output"):
                        report.finite &= bool(value.isfinite().all())
                pairs = differences(
                    on.runners[op], off.runners[op], bs, stale=dsa_serving.stale_steps(off)
                )
                report.reordered += reordered(on.runners[op], off.runners[op], bs, pairs)
                skip = dsa_serving.set_aside(off, op)
                pairs += dsa_serving.differences(on.runners[op], off.runners[op], bs, skip=skip)
                flags += [(op, name, differs) for name, differs in pairs]
            report.comparisons += len(flags)
            for op, name, differs in flags:
                if bool(differs):
                    report.mismatches.append(f"round {index}, {op} bs {bs} (raw {raw}): {name}")
    return report
