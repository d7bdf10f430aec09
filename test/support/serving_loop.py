"""The serving loop: EAGLE rounds replayed through SGLang's real DSA backends with the plugin on and
off in one process, every metadata buffer the captured graphs read compared bit for bit after every
replay, failures injected into the plugin's side, Triton's compiles counted.

For each EAGLE launch (3/1/4, 4/1/5, 5/1/6) and each kind of draft step (seeded: GLM-5 with index
share, the draft's top-k from draft extend; unseeded: DeepSeek-V3.2) one server
(:class:`~support.dsa_serving.Arm` twice, :data:`~.dsa_serving.ON` and
:data:`~.dsa_serving.OFF`, over one ``req_to_token``) captures every batch size SGLang captures
for ``--cuda-graph-max-bs-decode`` (:func:`~.dsa_serving.launch`), then serves rounds. A round is
what a decode step of SGLang's EAGLE v2 worker hands its three graph runners for one batch:

1. a captured batch size at random (none a fault victim holds: the victims' sizes are replayed in
   their own rounds only), and a batch of ``raw_bs`` requests that the runners pad to it (rows of
   length 1 in slot 0): ``raw_bs`` the bs one round in two, else drawn from 1 .. bs - 1 (SGLang
   pads only from the next smaller captured size, so most of these are padded deeper than a server
   pads them; the metadata must agree all the same); its requests continue from earlier rounds or
   are new, taking a free request slot whose ``req_to_token`` row is rewritten;
2. the draft decode (seq_lens: each request's length ``L``), the target verify (``L``), the draft
   extend after it (``L + draft tokens``: SGLang's ``prepare_for_draft_extend``, with the round's
   random accept lengths in ``spec_info``); the next round continues each request at
   ``L + accepted``. A request's first length is 0 .. context (about a third of the request replays
   past ``long_from``), with edge lengths (0, 1, a page, a 128-column block, the context) mixed in; a
   request that would run past the context ends;
3. every other round, the inputs as views at an address that is not 16-byte aligned.

Once per server, before the round halfway to the arming of its replay injections (below), both
arms recapture as SGLang recaptures while serving (a weight update with ``recapture_cuda_graph``,
elastic EP's scale-up: a new graph runner over the same backend, whose constructor calls its
``init_cuda_graph_state`` again, then captures every bs; :meth:`~.dsa_serving.Arm.recapture`):
every runner of both arms made anew over the same backend objects, their graph state made again,
every bs captured again (``_Server.recapture``). The host fields are compared again, the facts
that make each arm what it claims must hold again, and the rounds go on, compared as before: a
glue graph or a launch bound before the recapture that still runs after it writes buffers that no
new graph reads.

Before each replay both arms' buffers that the replay writes are poisoned
(:meth:`~.dsa_serving.Runner.poison`), then after both arms replayed every tensor their graphs read
is compared (:func:`~.dsa_serving.differences`): :data:`~.dsa_serving.READ`, whole, but the compact
page table's pages that SGLang's kernels write (its 128-column blocks), SGLang's JIT top-k plan as
its kernel defines it (:func:`~.dsa_serving.plan_differs`), and of the draft decode of seeded steps
not the indexer plans (:data:`~.dsa_serving.INDEXER_PLANS`, which no seeded step reads), nor those
SGLang's own prep leaves as they were (:func:`~.dsa_serving.stale_step_plans`: steps 0 to 2 under
its JIT multi-step copy). ``page_table_1`` is not read on
this path and the plugin drops it. The host fields (:data:`~.dsa_serving.STATIC`) are compared after
each capture. Every ``indexer_every`` rounds, SGLang's indexer (:class:`IndexerCalls`) computes a
top-k past the SM count with the live-width switch on and off: the top-k indices must be equal.

The plugin's launches are counted per replay (:class:`Calls`) where our kernels launch (Triton's
JIT in the wrappers, and the launches bound at capture), and SGLang's kernel behind our Fallbacks
apart:
ours must run in at least :data:`MIN_OURS` of each :data:`ENGAGED` op's replays, a replay without
it only at the op's fault victim; a replay must launch no more of ours, nor of SGLang's behind our
Fallbacks, than the Fallbacks it calls and the MTP plan send each way (``_Server.allowed``); a
plugin-off replay must launch none of ours; after each server every ``Fallback.failed`` and the MTP
batch sizes off the one launch hold exactly the injected victims. Per server and runner the report
has the replays by batch size and the padded ones (``ServerReport.batch_sizes``, ``padded``;
:func:`batch_size_table`). Some launches of
:data:`SPANNING` must have more live tiles than tile programs (on the CPU, ``cpu_budget``). The
counting leaves every call on the path a server takes: each kernel of :data:`BOUND` must launch
ours at some batch size no injection routes to SGLang's kernel, glued or eager (a glue replay's
launches are its capture's: :class:`Calls`), and on a GPU the launch bound at capture must take
every such launch (the CPU's interpreted kernels are never bound).

Failures injected (:class:`Injection`), each a ``RuntimeError`` with its own text, per server, at
four distinct captured batch sizes (``_victims``): our
target-verify kernel raising at its warm-up (capture) for one batch size; the MTP draft decode's
capture-time decision raising for another; our draft-extend kernel raising at a replay, and the MTP
one launch raising at a replay, each from a third of the way in; once per run, at its last indexer
call, the indexer's live copy raising at its second chunk. After each, the loop goes on, the comparisons hold, and exactly one
line of the plugin's log carries the text.

Triton's compiles (``compiles.count_compiles``) are counted around every replay of each arm. Every
kernel variant of ours and SGLang's replay-metadata kernels is forgotten first (``forget_compiled``):
the process starts as a fresh server. The arm with the plugin on must compile nothing after its
captures, fallback replays included; the arm with it off uses its own copy of SGLang's kernels
(``dsa_serving.sglang_metadata_kernels``) and compiles at first replays, as SGLang does. On a GPU
both are the counter's positive controls: the off arm's compiles while serving and the on arm's at
its captures (the warm-ups) must not be 0.

The negative control (``LoopConfig.sglang_only``, no injections): every captured bs of every
Fallback of the plugin-on arm sent to SGLang's kernel and off the MTP one launch after the capture;
no launch of ours may be counted, and the run fails on engagement.
:func:`run` returns a :class:`LoopReport`. :func:`run_plain` serves a server without speculative
decoding (its one runner, plain decode) the same way, without injections or indexer calls.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import logging
import random
import time
import weakref
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_dsa_mtp import log as plugin_log
from support import dsa_backends as kit
from support import dsa_serving as slice_
from support.compiles import count_compiles, forget_compiled
from support.constants import POISON
from support.reference import metadata_module

DESCRIBED = 5  # the first mismatches of a run told word by word (dsa_serving.describe)
LAUNCH_NAMES = ("3/1/4", "4/1/5", "5/1/6")
EDGES = (0, 1, 63, 64, 65, 127, 128, 129)  # and the context itself
# What the plugin-on arm's replays must run of ours: our target-verify and draft-extend kernels,
# our draft-decode metadata (the MTP one launch, or our decode kernel in every step backend), and
# within it the MTP one launch; each in at least MIN_OURS of its replays, the replays that did not
# run it all at its fault victims (``_Server.victims_of``). The indexer's live copy likewise, of
# the indexer calls.
ENGAGED = ("target verify", "draft extend", "draft decode", "MTP one launch")
MIN_OURS = 0.9
# With the metadata glue, the share of each runner's replays its glue must serve as one graph
# launch, padded replays included.
MIN_GLUED = 0.9
# A server with injections replays its victims' batch sizes in four rounds only (``run``), which
# leaves two draft decodes without the one launch: at least 20 rounds keep that within 10%.
MIN_ROUNDS_INJECTED = 20
# The kernels (named as ``Calls`` counts them) of which some launch must have more live tiles than
# tile programs, so that programs move on from one request to the next.
SPANNING = ("target verify", "draft extend", "MTP one launch")
INJECTIONS = ("capture", "warm-up", "replay", "one launch")  # the victims' keys
# The kernels whose launches are bound at capture (the Fallbacks' and the MTP one launch's): each
# must launch ours at a bs no injection routes, glued or eager; on a GPU, the bound launch must take
# every such launch (``Calls``, ``LoopReport.failures``).
BOUND = ("decode", "target verify", "draft extend", "MTP one launch")
# The kernel (``KERNELS``' name) whose backend attribute each runner's replay calls, in each
# backend its forward reads (``Runner.backends``: the draft decode's step backends, off the one
# launch).
RUNNER_KERNEL = {
    "target verify": "target verify",
    "draft extend": "draft extend",
    "draft decode": "decode",
}


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """One run of the loop: ``rounds`` in all, shared out among the servers in turn."""

    sizes: slice_.Sizes
    rounds: int
    # (EAGLE launch, seeded draft steps) of each server: by default every launch both ways.
    servers: tuple[tuple[str, bool], ...] = tuple(
        (name, seeded) for name in LAUNCH_NAMES for seeded in (True, False)
    )
    seed: int = 0
    indexer_every: int = 10  # rounds (over all servers) between two indexer calls; 0: none
    inject: bool = True
    # The bounded kernels' program budget for CPU tensors (``host.CPU_DEFAULT_BUDGET``) in the run:
    # below the batch sizes, so that programs take tiles of several requests (a CUDA device's
    # budget is its SM count's; at its 1M context, a request alone has more tiles than that).
    cpu_budget: int = 2
    # The negative control (no injections): after each capture, every Fallback of the plugin-on
    # arm sends every captured bs to SGLang's kernel and every MTP draft-decode bs is off the one
    # launch (``_Server.route_to_sglang``), so that no replay launches ours; the run must fail on
    # engagement and count no launch of ours.
    sglang_only: bool = False
    # The plugin-on arm's replay prep through the metadata glue (the plugin's default: every
    # runner's prep captured with the server's graphs, each replay one graph launch); False: its
    # eager prep (SGLANG_DSA_METADATA_GLUE=0).
    glue: bool = True


@dataclasses.dataclass
class Injection:
    """One failure injected into the plugin's side: where, the text it raises, how often it raised,
    and (at the end) the lines of the plugin's log that carry the text."""

    where: str  # "warm-up", "capture", "replay", "indexer"
    what: str
    text: str
    raised: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ServerReport:
    """One server of the loop."""

    name: str  # "EAGLE 4/1/5, seeded"
    captured: list[int]
    rounds: int = 0
    replays: dict[str, int] = dataclasses.field(default_factory=dict)  # per op, per arm
    comparisons: int = 0  # tensors compared
    mismatches: list[str] = dataclasses.field(default_factory=list)
    requests: int = 0  # request replays
    long_requests: int = 0  # of which past long_from
    engaged: dict[str, bool] = dataclasses.field(default_factory=dict)
    # Per ENGAGED op: the plugin-on arm's replays that ran ours.
    ours: dict[str, int] = dataclasses.field(default_factory=dict)
    # Replays that did not run ours outside a fault victim, a plugin-off replay that ran ours, a
    # Fallback.failed or an MTP batch size off the one launch that is not an injected victim.
    unexpected: list[str] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Per runner (``dsa_serving.OPS``): the plugin-on arm's replays by captured bs, and of them
    # those of a batch padded to it (fewer requests than the bs).
    batch_sizes: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    padded: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per runner, with the glue: the plugin-on arm's replays its glue served as one graph launch
    # (``Calls.glue_replays``), and its eager preps by reason (its glue state's at the end: after
    # the recapture, the target verify's new decode runner's).
    glued: dict[str, int] = dataclasses.field(default_factory=dict)
    glue_eager: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    recaptured_after: Optional[int] = None  # the rounds served before the recapture

    def ours_of(self, op: str) -> tuple[int, int]:
        """(replays that ran ours, replays) of an ENGAGED op."""
        return self.ours.get(op, 0), self.replays.get(op, self.replays.get("draft decode", 0))


@dataclasses.dataclass
class LoopReport:
    device: str
    context: int
    max_bs: int
    servers: list[ServerReport] = dataclasses.field(default_factory=list)
    injections: list[Injection] = dataclasses.field(default_factory=list)
    compiles_on: list[str] = dataclasses.field(default_factory=list)  # after the captures
    compiles_off: int = 0
    compiles_on_capture: int = 0  # the positive control on the on arm: its captures' warm-ups
    # Launches of our kernels while the on arm replayed (``Calls``), per kernel, and of those the
    # launches whose batch had more live tiles than the launch has tile programs.
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    spanned: dict[str, int] = dataclasses.field(default_factory=dict)
    # Runs of SGLang's kernel behind our Fallbacks while the on arm replayed, per kernel.
    fell_back: dict[str, int] = dataclasses.field(default_factory=dict)
    # The calls (of a backend attribute, of the MTP one launch) the counter took as launching ours,
    # per kernel: as many as ``calls``, or the counter credits a call that launched none.
    credited: dict[str, int] = dataclasses.field(default_factory=dict)
    # Of the calls that launched ours, those at a bs no injection routes to ours (``bindable``);
    # of those, the ones a launch bound at capture took (``bound``).
    bindable: dict[str, int] = dataclasses.field(default_factory=dict)
    bound: dict[str, int] = dataclasses.field(default_factory=dict)
    indexer_calls: int = 0  # per arm
    indexer_live_calls: int = 0  # of the on arm's calls, those the live copy answered
    indexer_mismatches: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # of the harness itself

    @property
    def replays(self) -> int:
        """Graph replays of the plugin-on arm (each compared with the off arm's)."""
        return sum(sum(server.replays.values()) for server in self.servers)

    @property
    def mismatches(self) -> list[str]:
        return [m for server in self.servers for m in server.mismatches] + self.indexer_mismatches

    def failures(self) -> list[str]:
        """Everything that makes the run fail, in words (empty: it passed)."""
        out = list(self.errors) + list(self.mismatches[:20])
        if self.compiles_on:
            out.append(f"the plugin-on arm compiled after its captures: {self.compiles_on[:10]}")
        for server in self.servers:
            out += [
                f"{server.name}: {fact} is not so" for fact, ok in server.engaged.items() if not ok
            ]
            out += [f"{server.name}: {line}" for line in server.unexpected[:20]]
            for op in ENGAGED:
                ran, replays = server.ours_of(op)
                if ran < MIN_OURS * replays:
                    out.append(f"{server.name}: ours ran in {ran} of {replays} {op} replays")
            for op, glued in server.glued.items():
                if glued < MIN_GLUED * server.replays[op]:
                    out.append(
                        f"{server.name}: the glue served {glued} of {server.replays[op]} {op} "
                        f"replays (eager: {server.glue_eager.get(op)})"
                    )
        missed = self.indexer_calls - self.indexer_live_calls
        injected = sum(i.raised for i in self.injections if i.where == "indexer")
        if self.indexer_calls and (
            missed > injected or self.indexer_live_calls < MIN_OURS * self.indexer_calls
        ):
            out.append(
                f"the live copy answered {self.indexer_live_calls} of {self.indexer_calls} indexer "
                f"calls ({injected} injected failures)"
            )
        if self.device.startswith("cuda"):  # compiled kernels are bound at capture
            out += [
                f"the bound launch took {self.bound.get(op, 0)} of {bindable} {op} launches of "
                "ours at a batch size no injection routes"
                for op, bindable in self.bindable.items()
                if op in BOUND and self.bound.get(op, 0) < bindable
            ]
        out += [
            f"the counter credited {self.credited.get(kernel, 0)} calls with a launch of {kernel}, "
            f"which launched {self.calls.get(kernel, 0)} times"
            for kernel in sorted(set(self.calls) | set(self.credited))
            if self.credited.get(kernel, 0) != self.calls.get(kernel, 0)
        ]
        if self.servers:
            out += [
                f"no {kernel} launch had more live tiles than tile programs"
                for kernel in SPANNING
                if not self.spanned.get(kernel)
            ]
            out += [
                f"the bound launch's check saw no {op} launch of ours at a batch size no injection "
                "routes"
                for op in BOUND
                if not self.bindable.get(op)
            ]
        if self.device.startswith("cuda") and not (self.compiles_off and self.compiles_on_capture):
            out.append(
                f"the compile counter saw {self.compiles_off} compiles of the plugin-off arm while "
                f"serving and {self.compiles_on_capture} of the plugin-on arm's captures: on a GPU "
                "both compile, so the counter is not counting"
            )
        for injection in self.injections:
            if not injection.raised:
                out.append(f"the {injection.where} injection ({injection.what}) never raised")
            if len(injection.lines) != 1:
                out.append(
                    f"the {injection.where} injection ({injection.what}) left "
                    f"{len(injection.lines)} log lines, not 1: {injection.lines[:3]}"
                )
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"replays": self.replays, "failures": self.failures()}


class Requests:
    """The server's running requests: a request slot and a length each. A new request takes a free
    slot (never slot 0) and a fresh random ``req_to_token`` row."""

    def __init__(self, sizes: slice_.Sizes, req_to_token: torch.Tensor, rng: random.Random, gen):
        self.sizes, self.req_to_token, self.rng, self.gen = sizes, req_to_token, rng, gen
        self.free = list(range(1, sizes.pool))
        self.running: dict[int, int] = {}  # slot -> length

    def first_length(self) -> int:
        """An edge length one time in ten, else past ``long_from`` two times in five (so that about
        a third of the request replays are long), else up to ``long_from``."""
        sizes, rng = self.sizes, self.rng
        draw = rng.random()
        if draw < 0.1:
            return rng.choice([*(n for n in EDGES if n <= sizes.context), sizes.context])
        if draw < 0.1 + 0.9 * 0.4:
            return rng.randint(sizes.long_from + 1, sizes.context)
        return rng.randint(0, sizes.long_from)

    def admit(self) -> None:
        slot = self.free.pop(self.rng.randrange(len(self.free)))
        self.req_to_token[slot].random_(0, 1 << 30, generator=self.gen)
        self.running[slot] = self.first_length()

    def batch(self, raw_bs: int) -> tuple[list[int], list[int]]:
        """(slots, lengths) of ``raw_bs`` running requests, new ones admitted as needed."""
        while len(self.running) < raw_bs:
            self.admit()
        slots = self.rng.sample(sorted(self.running), raw_bs)
        return slots, [self.running[slot] for slot in slots]

    def advance(self, slots, accepted, tokens: int) -> None:
        """Each request continues at its length + its accepted tokens, or ends (past the context,
        or by chance), freeing its slot."""
        for slot, step in zip(slots, accepted):
            length = self.running[slot] + step
            if length + tokens > self.sizes.context or self.rng.random() < 0.05:
                del self.running[slot]
                self.free.append(slot)
            else:
                self.running[slot] = length


def _raising_at(fn, bs: int, injection: Injection, armed=lambda: True):
    """``fn`` (a kernel wrapper called with ``bs=``) raising ``injection``'s error at ``bs``; its
    attributes (a wrapper's ``binder``) carried over."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs.get("bs") == bs and armed():
            injection.raised += 1
            raise RuntimeError(injection.text)
        return fn(*args, **kwargs)

    return call


def _inject(calls, fallback, bs: int, injection: Injection, armed=lambda: True) -> None:
    """Ours of ``fallback`` raising ``injection``'s error at ``bs``, where no launch is or will be
    bound (it would take the calls past ours); every other bs keeps the launch bound at its capture
    (``calls`` is told that ``bs`` is routed to ours)."""
    calls.routed.setdefault(fallback, set()).add(bs)
    fallback.ours = _raising_at(fallback.ours, bs, injection, armed)
    fallback.bound = _Unbound(bs, fallback.bound)


class _Unbound(dict):
    """A Fallback's bound launches, with none ever bound for ``bs`` (injected before the capture,
    whose warm-up binds)."""

    def __init__(self, bs: int, bound: dict):
        super().__init__((k, v) for k, v in bound.items() if k != bs)
        self.bs = bs

    def __setitem__(self, key, value) -> None:
        if key != self.bs:
            super().__setitem__(key, value)


class _CountedKernel:
    """One of our ``@triton.jit`` kernels as its wrapper launches it: ``kernel[grid](...)``
    launches the kernel (Triton's JIT, or its interpreter), then calls ``launched()``; everything
    else is the kernel's."""

    def __init__(self, kernel, launched):
        self._kernel, self._launched = kernel, launched

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def counted(*args, **kwargs):
            out = launch(*args, **kwargs)
            self._launched()
            return out

        return counted

    def __getattr__(self, name):
        return getattr(self._kernel, name)


class Calls:
    """The launches of our kernels, counted where each launches, and the runs of SGLang's kernel
    behind our Fallbacks, counted apart; neither changes the path a call takes.

    Ours: each replay-metadata wrapper (``support.launch_stubs.WRAPPERS``: decode, target verify,
    draft extend, the MTP one launch) launches its kernel one of two ways, both counted by the
    binder's op name: through Triton's JIT in the wrapper (``kernel[grid](...)``, the module global
    the wrapper launches through a counting stand-in, :class:`_CountedKernel`), or through a
    launch bound at capture (a ``launch.BoundLaunch`` call that returned True). The capture's
    probes and warm-ups launch outside :meth:`replay` and are not counted. A call that went to
    SGLang's kernel launches none of these: no count of ours is inferred from a Fallback's state.
    SGLang's: each plugin-on :class:`~sglang_dsa_mtp.integration.fallback.Fallback`'s ``sglang``
    counts a run by the Fallback's kernel name (:meth:`attach`). Both count inside :meth:`replay`
    only, by kernel.

    Per call of a backend attribute of ``dsa_metadata_selection.KERNELS`` (:meth:`attach`: the
    installed function through a counter) and of the MTP one launch's replay
    (``write_draft_decode_metadata`` through a counter) in which ours launched (``credited``: as
    many calls as launches, checked by ``LoopReport.failures``): whether its batch had more live
    tiles than the launch has tile programs (:func:`spans`); whether it was "bindable": at a bs
    no injection routes to ours (``routed``); and whether it was "bound": the launch bound at
    capture took it (on a GPU every bindable launch of :data:`BOUND` must be). A glue replay
    credits the launches and facts of the call its capture made (:meth:`_glued_launches`).

    ``glue_replays``: the on arm's replays of a graph a glue captured."""

    def __init__(self, monkeypatch):
        from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
        from sglang_dsa_mtp.kernels.ops import launch
        from support.launch_stubs import WRAPPERS

        self.launches: collections.Counter = collections.Counter()  # ours, on arm, by kernel
        self.fell_back: collections.Counter = collections.Counter()  # SGLang's behind ours, on arm
        self.bindable: collections.Counter = collections.Counter()  # of ours, at a bs not routed
        self.bound: collections.Counter = collections.Counter()  # of those, the bound launches'
        self.routed = weakref.WeakKeyDictionary()  # Fallback -> the bs its injection routes
        self.spanned: collections.Counter = collections.Counter()
        self.credited: collections.Counter = collections.Counter()  # calls that launched ours
        self._ours: collections.Counter = collections.Counter()  # every launch of ours
        self._bound: collections.Counter = collections.Counter()  # of those, a bound launch's
        self.glue_replays = 0
        self._now: Optional[collections.Counter] = None
        self._sglang_now: Optional[collections.Counter] = None
        self._arm: Optional[str] = None
        self._glued_launches(monkeypatch)
        for wrapper, module, name in WRAPPERS:
            launched = functools.partial(self._launched, wrapper.binder.what)
            monkeypatch.setattr(module, name, _CountedKernel(getattr(module, name), launched))
        bound_call = launch.BoundLaunch.__call__

        def bound(self_, kwargs) -> bool:
            launched = bound_call(self_, kwargs)
            if launched:
                self._launched(self_.binder.what, bound=True)
            return launched

        monkeypatch.setattr(launch.BoundLaunch, "__call__", bound)
        write = mtp.write_draft_decode_metadata

        def write_draft_decode_metadata(multi, forward_batch, plan):
            kwargs = mtp.one_launch_call(plan, forward_batch)
            return self._counted_call(
                "MTP one launch", kwargs, True, lambda: write(multi, forward_batch, plan)
            )

        monkeypatch.setattr(mtp, "write_draft_decode_metadata", write_draft_decode_metadata)

    def attach(self, arm) -> None:
        from sglang_dsa_mtp.integration.dsa_metadata_selection import KERNELS
        from sglang_dsa_mtp.integration.fallback import fallback_of

        for backend in arm.backends().values():
            for attr, kernel, name in KERNELS:
                installed = getattr(backend, attr)
                fallback = fallback_of(installed)
                if fallback is None:
                    continue
                fallback.sglang = self._sglang_counted(fallback.sglang, name)
                if fallback.ours is kernel:
                    setattr(backend, attr, self._counted(installed, fallback, name))

    def _sglang_counted(self, sglang, name: str):
        def call(*args, **kwargs):
            out = sglang(*args, **kwargs)
            self._launched(name, ours=False)
            return out

        return call

    def _counted(self, installed, fallback, name: str):
        def call(*args, **kwargs):
            bindable = kwargs.get("bs") not in self.routed.get(fallback, ())
            return self._counted_call(name, kwargs, bindable, lambda: installed(*args, **kwargs))

        call.fallback = fallback  # fallback_of finds it through the counter
        return call

    def _counted_call(self, name: str, kwargs: dict, bindable: bool, call):
        """``call()``, and if it launched ours, what the call tells (:meth:`_facts`)."""
        ours, bound = self._ours[name], self._bound[name]
        out = call()
        if self._ours[name] > ours:
            self._facts(name, kwargs, bound=self._bound[name] > bound, bindable=bindable)
        return out

    def _glued_launches(self, monkeypatch) -> None:
        """A glue graph's replay launches what its capture recorded: the launches (and the calls'
        facts) made while SGLang's ``MetadataGlueGraph.run`` captured a key are kept for the graph
        it captured, and each replay of that graph (``torch.cuda.CUDAGraph.replay``, whichever
        way the glue reaches it) counts them again, as made then, on the buffers the capture
        read: a launch bound at capture that took a call inside the glue's capture is what the
        graph replays, bound, and a call at a bs no injection routes is bindable there as at an
        eager replay; what runs on the host during that replay is not counted (the simulated
        graphs off a GPU make the captured calls again)."""
        from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

        self._recording: Optional[list] = None
        # A glue's graph -> its capture's calls of _launched and _facts (gone with the graph).
        self._recorded = weakref.WeakKeyDictionary()
        self._glued = False
        run, replay = MetadataGlueGraph.run, torch.cuda.CUDAGraph.replay

        def captured(glue, key):
            record = glue._states.get(key)  # SGLang's per-key record
            return None if record is None else record["graph"]

        def counted_run(glue, attn_backend, fb_view, key) -> None:
            if captured(glue, key) is not None:  # a replay, counted by its graph's
                return run(glue, attn_backend, fb_view, key)
            outer, self._recording = self._recording, []
            try:
                run(glue, attn_backend, fb_view, key)
            finally:
                events, self._recording = self._recording, outer
            graph = captured(glue, key)
            if graph is not None:  # this call captured the key
                self._recorded[graph] = events

        def counted_replay(graph) -> None:
            events = self._recorded.get(graph)
            if events is None:  # no glue's graph (a runner's)
                return replay(graph)
            self._glue_replay(events, lambda: replay(graph))

        monkeypatch.setattr(MetadataGlueGraph, "run", counted_run)
        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted_replay)

    def _glue_replay(self, events: list, replay) -> None:
        self._glued = True
        try:
            replay()
        finally:
            self._glued = False
        self.glue_replays += self._arm == "on"
        for event in events:
            event()

    def _launched(self, name: str, *, ours: bool = True, bound: bool = False) -> None:
        """One launch of kernel ``name``: ours (``bound``: a bound launch's), or SGLang's behind
        one of our Fallbacks."""
        if self._glued:
            return
        if self._recording is not None:
            self._recording.append(functools.partial(self._launched, name, ours=ours, bound=bound))
        if ours:
            self._ours[name] += 1
            self._bound[name] += bound
        if self._now is not None:
            (self._now if ours else self._sglang_now)[name] += 1
            if self._arm == "on":
                (self.launches if ours else self.fell_back)[name] += 1

    def _facts(self, name: str, kwargs: dict, *, bound: bool, bindable: bool) -> None:
        """What one call in which ours launched tells, counted while the on arm replays."""
        if self._recording is not None:
            self._recording.append(
                functools.partial(self._facts, name, kwargs, bound=bound, bindable=bindable)
            )
        if self._arm == "on":
            self.credited[name] += 1
            self.bindable[name] += bindable
            self.bound[name] += bound and bindable
            self.spanned[name] += spans(**kwargs)

    @contextlib.contextmanager
    def replay(self, arm: str):
        """The launches while ``arm`` ("on", "off") replays: (ours, SGLang's kernel's behind our
        Fallbacks), Counters by kernel."""
        self._now, self._sglang_now, self._arm = collections.Counter(), collections.Counter(), arm
        try:
            yield self._now, self._sglang_now
        finally:
            self._now = self._sglang_now = self._arm = None


def spans(
    *, bs, seq_lens, max_len=None, max_seqlen_k=None, next_n=0, destinations=None, **_
) -> bool:
    """Whether a bounded launch of these keyword arguments (SGLang's, or the one launch's) has more
    live ``TILE_N``-column tiles than tile programs: then some program takes several tiles, of
    several requests where a request has at most one tile (the CPU's 128-token context). A request's
    tiles cover its KV length (``seq_lens``, + ``next_n`` in a target verify) rounded up to SGLang's
    128-column blocks, within the table's width; the programs are ``bounded_num_programs`` of the
    device's default budget (the decode replay's: ``decode_programs_per_sm``)."""
    from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_bounded import decode_programs_per_sm
    from sglang_dsa_mtp.kernels.ops.attention.dsa_metadata_common import (
        TILE_N,
        bounded_num_programs,
    )
    from sglang_dsa_mtp.kernels.ops.host import PROGRAMS_PER_SM, default_budget

    width = max_len if max_len is not None else max_seqlen_k
    kv = seq_lens[:bs].to(torch.int64) + next_n
    block = slice_.SGLANG_BLOCK_N
    live_end = ((kv.clamp(min=0) + block - 1) // block * block).clamp(max=width)
    tiles = int(((live_end + TILE_N - 1) // TILE_N).sum())
    decode_replay = max_len is not None and destinations is None
    per_sm = decode_programs_per_sm(bs) if decode_replay else PROGRAMS_PER_SM
    return tiles > bounded_num_programs(bs, width, default_budget(seq_lens.device, per_sm))


class IndexerCalls:
    """SGLang's ``Indexer`` (its constructor, on the device; its rotary embedding, which
    ``_get_topk_paged`` does not use, an identity) computing a draft-extend top-k of more rows than
    its SM count (3 chunks): SGLang's ``_get_topk_paged`` with SGLang's torch paged-MQA logits
    (``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1``) and torch top-k, over a real ``DSATokenToKVPool`` of
    random keys, DeepGEMM's schedule a stand-in (the torch logits ignore it). New lengths at every
    call. On the GPU: the device's SM count (the plugin's hook on ``Indexer.__init__`` compiles the
    live copy there), 8,256 columns, 64 heads; on the CPU: 4 SMs, 2,176 columns, 16 heads."""

    TOKENS = 5  # rows per request: EAGLE 4/1/5's draft extend

    def __init__(self, monkeypatch, device: torch.device, generator: torch.Generator):
        from sglang.srt.layers.attention.dsa import dsa_indexer
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

        from support.indexer_cases import schedule_stand_in

        self.device = device
        monkeypatch.setattr(
            dsa_indexer, "resolve_paged_mqa_logits_metadata_fn", lambda: schedule_stand_in
        )
        self._schedule = schedule_stand_in
        cuda = device.type == "cuda"
        pages_per_row, heads = (129, 64) if cuda else (34, 16)
        self.width = pages_per_row * 64
        config = DeepseekV32Config(index_topk=2048 if cuda else 64)
        self.pages = 2 * pages_per_row + 1
        with self.torch_logits():  # as the indexer's calls run
            self.indexer = kit.sglang_indexer(config, device)
        # SGLang's runtime context (its parallel widths), which the pool's constructor reads.
        with kit.serving(None):
            self.pool = DSATokenToKVPool(
                size=64 * self.pages,
                page_size=64,
                kv_lora_rank=512,
                dtype=torch.bfloat16,
                qk_rope_head_dim=64,
                layer_num=1,
                device=str(device),
                index_head_dim=128,
                enable_memory_saver=False,
                kv_cache_dim=576,
            )
        if not cuda:
            self.indexer.sm_count = 4  # SGLang sets resolve_num_sms() on CUDA only
        self.sm_count = self.indexer.sm_count
        self.requests = -(-(2 * self.sm_count + 1) // self.TOKENS)  # rows past two chunks
        index_k = self.pool.get_index_k_with_scale_buffer(layer_id=0)
        cpu = torch.Generator().manual_seed(generator.initial_seed())
        values = torch.randn(index_k.shape[0], 64 * 128, generator=cpu).to(torch.float8_e4m3fn)
        scales = torch.rand(index_k.shape[0], 64, generator=cpu) + 0.5
        index_k.copy_(torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=1))
        rows = self.requests * self.TOKENS
        self.q = torch.randn(rows, heads, 128, generator=cpu).to(torch.float8_e4m3fn).to(device)
        self.weights = torch.randn(rows, heads, 1, generator=cpu).to(device)
        self.block_tables = torch.stack(
            [
                torch.randperm(self.pages - 1, generator=cpu)[:pages_per_row] + 1
                for _ in range(self.requests)
            ]
        ).to(torch.int32)

    @contextlib.contextmanager
    def torch_logits(self):
        """SGLang's torch paged-MQA logits (``dsa_backends.torch_logits``) and its unfused torch
        top-k, for the block."""
        with kit.torch_logits(), slice_.switches({"SGLANG_DSA_FUSE_TOPK": "0"}):
            yield

    def metadata(self, prefixes: list[int]):
        """SGLang's ``DSAIndexerMetadata`` of a draft extend of ``prefixes`` (each request's rows see
        its prefix + 1 .. + 5 tokens)."""
        from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
        from sglang.srt.layers.attention.dsa.dsa_topk_backend import (
            DSATopKBackend,
            TopkTransformMethod,
        )
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend, DSAMetadata
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        device, next_n, bs = self.device, self.TOKENS, len(prefixes)
        seq = torch.tensor(prefixes, dtype=torch.int32, device=device)
        cache_seqlens = seq + next_n
        offsets = torch.arange(next_n, dtype=torch.int32, device=device).repeat(bs) + 1
        expanded = (seq.repeat_interleave(next_n) + offsets).to(torch.int32)
        ctx_lens = DeepseekSparseAttnBackend._build_paged_mqa_schedule_2d_ctx_lens(
            SimpleNamespace(speculative_num_draft_tokens=next_n),
            ForwardMode.DRAFT_EXTEND_V2,
            cache_seqlens,
            expanded,
            bs,
        )
        rows = bs * next_n
        return DSAIndexerMetadata(
            attn_metadata=DSAMetadata(
                page_size=64,
                cache_seqlens_int32=cache_seqlens,
                max_seq_len_q=next_n,
                max_seq_len_k=self.width,
                cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
                cu_seqlens_k=None,
                page_table_1=None,
                real_page_table=self.block_tables.to(device).repeat_interleave(next_n, 0),
                dsa_cache_seqlens_int32=expanded.clamp(max=self.indexer.index_topk),
                dsa_cu_seqlens_q=None,
                dsa_cu_seqlens_k=None,
                dsa_extend_seq_lens_list=[next_n] * bs,
                dsa_seqlens_expanded=expanded,
                paged_mqa_schedule_metadata=self._schedule(ctx_lens, 64, self.sm_count),
                paged_mqa_ctx_lens_2d=ctx_lens,
            ),
            topk_transform_method=TopkTransformMethod.PAGED,
            topk_backend=DSATopKBackend.TORCH,
        )

    def topk(self, env: dict, metadata) -> torch.Tensor:
        """SGLang's ``Indexer._get_topk_paged`` with the live-width switch at ``env``."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        batch = SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2)
        context = ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=self.pool))
        with kit.serving(None), self.torch_logits(), slice_.switches(env), forward_context(context):
            return self.indexer._get_topk_paged(batch, 0, self.q, self.weights, metadata)

    def call(self, rng: random.Random) -> Optional[str]:
        """One call with new lengths, on and off; what differs, or None."""
        prefixes = [
            rng.choice([0, 1, 63, 64, 65, rng.randint(0, self.width - self.TOKENS)])
            for _ in range(self.requests)
        ]
        prefixes[0] = self.width - self.TOKENS  # one row reaching the full width
        metadata = self.metadata(prefixes)
        ours = self.topk(slice_.ON, metadata)
        stock = self.topk(slice_.OFF, metadata)
        if ours.shape != stock.shape or not torch.equal(ours, stock):
            return f"indexer top-k of prefixes {prefixes[:4]}... differs"
        return None


class _LogLines(logging.Handler):
    """Every message the plugin logs, at INFO and above."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _plugin_log():
    logger = logging.getLogger("sglang_dsa_mtp")
    handler, level = _LogLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def forget_all_compiled(device: torch.device) -> None:
    """Drop every compiled variant of our kernels and of SGLang's replay-metadata kernels (a fresh
    server process), on a GPU also of the plugin-off arm's own copy of SGLang's kernels
    (``dsa_serving.sglang_metadata_kernels``: an earlier run in the process compiled them too); the
    live copy's start-up warm-up is then redone by :class:`IndexerCalls`."""
    import sglang.kernels.ops.attention.dsa.metadata as sglang_metadata
    from triton.runtime.jit import JITFunction

    from sglang_dsa_mtp.kernels.ops.attention import (
        dsa_draft_decode_metadata,
        dsa_metadata_bounded,
        dsa_paged_mqa_logits_live,
    )

    modules = (dsa_metadata_bounded, dsa_draft_decode_metadata, dsa_paged_mqa_logits_live)
    modules += (sglang_metadata, metadata_module()) if device.type == "cuda" else (sglang_metadata,)
    kernels = [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, JITFunction)
    ]
    forget_compiled(*kernels)
    dsa_paged_mqa_logits_live._warm_devices.clear()


class _Server:
    """One server of the loop: its two arms, requests, injections, report."""

    def __init__(
        self,
        config: LoopConfig,
        launch_name: str,
        seeded: bool,
        captured,
        rng,
        gen,
        *,
        calls: Calls,
        victims: dict,
    ):
        sizes = config.sizes
        self.sizes, self.rng, self.gen = sizes, rng, gen
        self.steps, _, self.tokens = kit.LAUNCHES[launch_name]
        self.seeded = seeded
        name = f"EAGLE {launch_name}, {'seeded' if seeded else 'unseeded'}"
        self.report = ServerReport(name=name, captured=list(captured))
        self.report.replays = {op: 0 for op in slice_.OPS}
        self.report.batch_sizes = {op: {} for op in slice_.OPS}
        self.report.padded = {op: 0 for op in slice_.OPS}
        self.report.glued = {op: 0 for op in slice_.OPS} if config.glue else {}
        self.captured = sorted(captured)
        width = sizes.context + 4 + self.tokens
        self.req_to_token = torch.zeros(sizes.pool, width, dtype=torch.int32, device=sizes.device)
        self.req_to_token[1:].random_(0, 1 << 30, generator=gen)
        common = dict(
            sizes=sizes, tokens=self.tokens, req_to_token=self.req_to_token, seeded=seeded
        )
        start = time.perf_counter()
        self.glue = config.glue
        on = slice_.ON if config.glue else {**slice_.ON, slice_.GLUE_ENV: "0"}
        self.on = slice_.Arm("plugin on", on, **common)
        self.off = slice_.Arm(
            "plugin off",
            slice_.OFF,
            kernels=slice_.sglang_metadata_kernels(sizes.device),
            **common,
        )
        self.report.seconds["build"] = time.perf_counter() - start
        self.requests = Requests(sizes, self.req_to_token, rng, gen)
        self.injections: list[Injection] = []
        self.armed = False
        self.calls = calls
        for arm in (self.on, self.off):
            calls.attach(arm)
        self.fallbacks = _fallbacks_called(self.on)
        self.report.ours = {op: 0 for op in ENGAGED}
        # The batch sizes at which an ENGAGED op may run SGLang's path instead of ours.
        self.victims_of = {op: set() for op in ENGAGED}
        if victims:
            self.victims_of["target verify"].add(victims["warm-up"])
            self.victims_of["draft extend"].add(victims["replay"])
            self.victims_of["MTP one launch"].update((victims["capture"], victims["one launch"]))
        # The rounds' random batch sizes: the victims' replayed in their own rounds only (``run``).
        self.regular = [bs for bs in self.captured if bs not in victims.values()]
        # (the Fallback or "MTP", the victim bs, the injection): what may fall back, and why.
        # (None for the negative control's routing, ``route_to_sglang``.)
        self.injected: list[tuple[object, int, Optional[Injection]]] = []

    # --- injections -------------------------------------------------------------------------------

    def _injection(self, where: str, what: str) -> Injection:
        text = f"injected at {where}: {self.report.name}, {what}"
        injection = Injection(where=where, what=f"{self.report.name}, {what}", text=text)
        self.injections.append(injection)
        return injection

    def inject_before_capture(self, monkeypatch, victims: dict) -> None:
        """Our target-verify kernel raising at its warm-up for ``victims["warm-up"]``, the MTP
        capture decision raising for ``victims["capture"]``."""
        from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
        from sglang_dsa_mtp.integration.fallback import fallback_of

        bs = victims["warm-up"]
        verify = fallback_of(self.on.target._fused_verify_metadata)
        if verify is not None:
            injection = self._injection("warm-up", f"target verify bs {bs}")
            _inject(self.calls, verify, bs, injection)
            self.injected.append((verify, bs, injection))
        bs = victims["capture"]
        injection = self._injection("capture", f"MTP draft decode bs {bs}")
        self.injected.append(("MTP", bs, injection))
        decide, multi = mtp.one_launch_kwargs, self.on.multi

        def one_launch_kwargs(owner, metas, at_bs):
            if owner is multi and at_bs == bs:
                injection.raised += 1
                raise RuntimeError(injection.text)
            return decide(owner, metas, at_bs)

        monkeypatch.setattr(mtp, "one_launch_kwargs", one_launch_kwargs)

    def inject_at_replay(self, monkeypatch, victims: dict) -> None:
        """Our draft-extend kernel raising at a replay of ``victims["replay"]``, the MTP one launch
        raising at a replay of ``victims["one launch"]``, both once :attr:`armed`."""
        from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
        from sglang_dsa_mtp.integration.fallback import fallback_of

        armed = lambda: self.armed  # noqa: E731
        bs = victims["replay"]
        extend = fallback_of(self.on.extend._fused_draft_extend_metadata)
        if extend is not None:
            injection = self._injection("replay", f"draft extend bs {bs}")
            _inject(self.calls, extend, bs, injection, armed)
            self.injected.append((extend, bs, injection))
        bs = victims["one launch"]
        injection = self._injection("replay", f"MTP one launch bs {bs}")
        self.injected.append(("MTP", bs, injection))
        write, multi = mtp.write_draft_decode_metadata, self.on.multi

        def write_draft_decode_metadata(owner, forward_batch, plan):
            if owner is multi and plan.launch["bs"] == bs and self.armed:
                injection.raised += 1
                raise RuntimeError(injection.text)
            return write(owner, forward_batch, plan)

        monkeypatch.setattr(mtp, "write_draft_decode_metadata", write_draft_decode_metadata)

    # --- capture ----------------------------------------------------------------------------------

    def capture(self, counters: dict, *, again: bool = False) -> None:
        """Both arms capture every batch size (:func:`capture_arms`), the on arm's compiles counted,
        the host fields that differ reported as mismatches."""
        start = time.perf_counter()
        compiled, differing = capture_arms(self.on, self.off, self.captured, again=again)
        counters["on capture"] += compiled
        when = "recapture" if again else "capture"
        self.report.seconds[when] = time.perf_counter() - start
        self.report.mismatches += [f"{self.report.name}, {when}, {d}" for d in differing]

    def recapture(self, counters: dict) -> None:
        """Mid-run, SGLang's recapture while serving: every runner of both arms made anew over the
        same backends, each backend's graph state made again, every batch size captured again
        (:meth:`capture`); the facts of :meth:`check_engaged` must hold after it as after the
        capture, and the rounds go on, compared as before."""
        self.capture(counters, again=True)
        self.check_engaged(when=", after the recapture")
        self.report.recaptured_after = self.report.rounds

    def check_engaged(self, when: str = "") -> None:
        """The facts that make the on arm the plugin's and the off arm SGLang's, each True when it
        holds (the MTP victims' batch sizes aside), each named with ``when`` after it."""
        from sglang_dsa_mtp.integration.fallback import fallback_of
        from sglang_dsa_mtp.integration.state import MultiStepState, peek

        facts = {}
        for arm, on in ((self.on, True), (self.off, False)):
            backends = list(arm.backends().values())
            kernels = [
                fallback_of(getattr(b, attr)) is not None
                for b in backends
                for attr in ("_fused_verify_metadata", "_fused_draft_extend_metadata")
            ]
            dropped = [b.dsa_drop_wide_page_table for b in backends]
            plans = peek(arm.multi, MultiStepState).batch_sizes
            one_launch = [bs for bs in self.captured if bs in plans and plans[bs].reason is None]
            if on:
                facts["on: every backend has the bounded kernels"] = all(kernels)
                facts["on: no backend has a wide page_table_1"] = all(dropped)
                facts["on: the target has a QLEN_ONLY verify mask"] = (
                    arm.target.verify_mask is not None
                )
                victims = {bs for owner, bs, _ in self.injected if owner == "MTP"}
                facts["on: the MTP draft decode takes the one launch"] = set(one_launch) >= (
                    set(self.captured) - victims
                )
                if self.glue:
                    facts["on: every runner's prep is captured in its glue, every bs"] = all(
                        _captured_every_bs(arm, self.captured)
                    )
                if self.glue and self.sizes.device.type == "cuda":
                    facts["on: no glue graph holds memory in a pool of its own"] = not (
                        _glue_graphs_with_own_pool(arm)
                    )
            else:
                facts["off: every backend has SGLang's kernels"] = not any(kernels)
                facts["off: every backend keeps its wide page_table_1"] = not any(dropped)
                facts["off: the target has no verify mask"] = arm.target.verify_mask is None
                facts["off: the MTP draft decode takes SGLang's precompute"] = not one_launch
                facts["off: no runner's prep has a glue"] = not any(
                    _captured_every_bs(arm, self.captured)
                )
        self.report.engaged.update({fact + when: ok for fact, ok in facts.items()})

    def check_fallen_back(self) -> None:
        """Every ``Fallback.failed`` of the on arm, and its MTP batch sizes off the one launch: the
        injected victims whose injection raised, nothing else."""
        from sglang_dsa_mtp.integration.dsa_metadata_selection import KERNELS
        from sglang_dsa_mtp.integration.fallback import fallback_of
        from sglang_dsa_mtp.integration.state import MultiStepState, peek

        def expected(owner) -> set:
            return {
                bs
                for o, bs, injection in self.injected
                if o is owner and (injection is None or injection.raised)
            }

        unexpected = self.report.unexpected
        for role, backend in self.on.backends().items():
            for attr, _, name in KERNELS:
                fallback = fallback_of(getattr(backend, attr))
                if fallback is not None and fallback.failed != expected(fallback):
                    unexpected.append(
                        f"the {role}'s {name} Fallback.failed is {sorted(fallback.failed)}, the "
                        f"injected victims {sorted(expected(fallback))}"
                    )
        plans = peek(self.on.multi, MultiStepState).batch_sizes
        off = {bs for bs, plan in plans.items() if plan.reason is not None}
        if off != expected("MTP"):
            unexpected.append(
                f"the MTP batch sizes off the one launch are {sorted(off)}, the injected victims "
                f"{sorted(expected('MTP'))}"
            )

    # --- rounds -----------------------------------------------------------------------------------

    def round(self, index: int, bs: int, counters: dict) -> None:
        sizes, rng, report = self.sizes, self.rng, self.report
        raw_bs = raw_batch_size(bs, rng)
        slots, lengths = self.requests.batch(raw_bs)
        accepted = [rng.randint(1, self.tokens) for _ in slots]
        odd = index % 2 == 1
        device = sizes.device
        slot_t = slice_.request_tensor(slots, device, odd=odd)
        inputs = {
            "draft decode": slice_.request_tensor(lengths, device, odd=odd),
            "target verify": slice_.request_tensor(lengths, device, odd=odd),
            "draft extend": slice_.request_tensor(
                [n + self.tokens for n in lengths], device, odd=odd
            ),
        }
        accepted_t = torch.tensor(accepted, dtype=torch.int32, device=device)
        flags = []
        for op in ("draft decode", "target verify", "draft extend"):
            for arm in (self.on, self.off):
                arm.runners[op].poison(bs, POISON)
            extra = accepted_t if op == "draft extend" else None
            glued = self.calls.glue_replays
            with count_compiles() as compiled, self.calls.replay("on") as (ran, fell_back):
                self.on.replay(op, bs, inputs[op], slot_t, extra)
            counters["on"] += compiled.names
            if self.glue:
                report.glued[op] += self.calls.glue_replays - glued
            with count_compiles() as compiled, self.calls.replay("off") as (ran_off, _):
                self.off.replay(op, bs, inputs[op], slot_t, extra)
            counters["off"] += len(compiled.names)
            report.replays[op] += 1
            report.batch_sizes[op][bs] = report.batch_sizes[op].get(bs, 0) + 1
            report.padded[op] += raw_bs < bs
            self.engagement(f"round {index}, {op} bs {bs}", op, bs, ran, ran_off, fell_back)
            skip = slice_.set_aside(self.off, op)
            for name, differs in slice_.differences(
                self.on.runners[op], self.off.runners[op], bs, skip=skip
            ):
                flags.append((op, name, differs))
        values = [f for _, _, f in flags if isinstance(f, torch.Tensor)]
        resolved = iter(torch.stack(values).tolist() if values else [])
        report.comparisons += len(flags)
        for op, name, differs in flags:
            if isinstance(differs, torch.Tensor):
                differs = next(resolved)
            if differs:
                label = f"round {index}, {op} bs {bs} (raw {raw_bs}): {name}"
                note_mismatch(report, label, self.on.runners[op], self.off.runners[op], bs, name)
        report.rounds += 1
        report.requests += len(lengths)
        report.long_requests += sum(n > sizes.long_from for n in lengths)
        self.requests.advance(slots, accepted, self.tokens)

    def engagement(self, label: str, op: str, bs: int, ran, ran_off, fell_back) -> None:
        """Count the ENGAGED ops whose ours ran in one replay of ``op`` (``ran``: the on arm's
        launches of ours, :class:`Calls`); note a miss outside the op's victims, any launch of
        ours in the off arm's replay, and launches of ours or runs of SGLang's kernel behind our
        Fallbacks (``fell_back``) past what the replay's Fallbacks and MTP plan allow
        (:meth:`allowed`): ours where SGLang's kernel has the bs, or the other way round."""
        report = self.report
        if ran_off:
            report.unexpected.append(f"{label}: the plugin-off arm ran ours: {dict(ran_off)}")
        for whose, counted, most in zip(
            ("ours", "SGLang's"), (ran, fell_back), self.allowed(op, bs)
        ):
            over = {name: (n, most[name]) for name, n in counted.items() if n > most[name]}
            if over:
                report.unexpected.append(
                    f"{label}: {whose} launched more than the replay's Fallbacks and MTP plan "
                    f"allow (kernel: (launches, allowed)): {over}"
                )
        if op == "draft decode":
            steps = len(self.on.step_backends())
            one_launch = ran["MTP one launch"] > 0
            done = {"draft decode": one_launch or ran["decode"] >= steps}
            done["MTP one launch"] = one_launch
        else:
            done = {op: ran[op] > 0}
        for name, ours in done.items():
            if ours:
                report.ours[name] += 1
            elif bs not in self.victims_of[name]:
                report.unexpected.append(
                    f"{label}: ours did not run ({name}; launches {dict(ran)})"
                )

    def allowed(self, op: str, bs: int) -> tuple[collections.Counter, collections.Counter]:
        """(the most launches of ours, the most runs of SGLang's kernel behind our Fallbacks) that a
        replay of ``op`` at ``bs`` may count, by kernel: one per Fallback the replay calls
        (:attr:`fallbacks`), ours where its ``failed`` lacks ``bs``, else SGLang's; and in a draft
        decode one MTP one launch where the MTP plan of ``bs`` takes it."""
        from sglang_dsa_mtp.integration.state import MultiStepState, peek

        ours, sglang = collections.Counter(), collections.Counter()
        for name, fallback in self.fallbacks[op]:
            (sglang if bs in fallback.failed else ours)[name] += 1
        if op == "draft decode":
            plan = peek(self.on.multi, MultiStepState).batch_sizes.get(bs)
            ours["MTP one launch"] += plan is not None and plan.reason is None
        return ours, sglang

    def route_to_sglang(self, monkeypatch) -> None:
        """The negative control (``LoopConfig.sglang_only``), before the capture (so that a glue
        captures what the replays then run): every Fallback of the on arm sends every captured bs
        to SGLang's kernel (each in its ``failed``), and every captured bs of the MTP draft decode
        is decided off the one launch (the path a bs whose one launch raised takes); both recorded
        as what :meth:`check_fallen_back` expects."""
        from sglang_dsa_mtp.integration import dsa_mtp_draft_metadata as mtp
        from sglang_dsa_mtp.integration.dsa_metadata_selection import KERNELS
        from sglang_dsa_mtp.integration.fallback import fallback_of

        for backend in self.on.backends().values():
            for attr, _, _ in KERNELS:
                fallback = fallback_of(getattr(backend, attr))
                if fallback is not None:
                    fallback.failed.update(self.captured)
                    self.injected += [(fallback, bs, None) for bs in self.captured]
        decide, multi = mtp.why_not_one_launch, self.on.multi

        def why_not_one_launch(owner, bs):
            return "the negative control" if owner is multi else decide(owner, bs)

        monkeypatch.setattr(mtp, "why_not_one_launch", why_not_one_launch)
        self.injected += [("MTP", bs, None) for bs in self.captured]

    # --- the metadata glue ------------------------------------------------------------------------

    def arm_in_glue_captures(self, monkeypatch) -> None:
        """The replay injections armed while a glue of the on arm runs a prep to capture it (its
        eager warm-ups and its capture, at the server's capture): with the glue, no code of ours
        runs at a replay, so a failure of ours can only happen there."""
        from sglang_dsa_mtp.integration import dsa_metadata_glue as glue

        capture_key = glue._capture_key

        def armed(*args, **kwargs):
            self.armed = True
            try:
                return capture_key(*args, **kwargs)
            finally:
                self.armed = False

        monkeypatch.setattr(glue, "_capture_key", armed)

    def count_glue_eager(self) -> None:
        """Per runner of the on arm, with the glue: its eager preps by reason."""
        if not self.glue:
            return
        for op, (_, counts) in arm_glues(self.on).items():
            if counts is not None:
                self.report.glue_eager[op] = dict(counts.eager)


def capture_arms(on, off, batch_sizes, *, again: bool) -> tuple[int, list[str]]:
    """Both arms capture every batch size of ``batch_sizes`` (``again``: recapture, as SGLang does
    while serving, ``dsa_serving.Arm.recapture``); (the Triton compiles of the on arm's capture,
    the host fields of each runner and bs that differ between the arms, as ``"op bs N: field"``)."""
    compiled_on = 0
    for arm in (on, off):
        with count_compiles() as compiled:
            if again:
                arm.recapture(batch_sizes)
            else:
                arm.capture(batch_sizes)
        if arm is on:
            compiled_on = len(compiled.names)
    differing = [
        f"{op} bs {bs}: {name}"
        for op in on.runners
        for bs in batch_sizes
        for name in slice_.static_differences(on.runners[op], off.runners[op], bs)
    ]
    return compiled_on, differing


def note_mismatch(report, label: str, on, off, bs: int, name: str) -> None:
    """``name`` differs between the arms' reads of ``bs`` (``on``, ``off``: the runners): recorded
    in ``report`` under ``label``, told word by word (:func:`~.dsa_serving.describe`) while the
    run has fewer than :data:`DESCRIBED` mismatches."""
    text = f"{report.name}, {label}"
    if len(report.mismatches) < DESCRIBED:
        text += f" ({slice_.describe(on, off, bs, name)})"
    report.mismatches.append(text)


def raw_batch_size(bs: int, rng: random.Random) -> int:
    """The requests of a round at the captured ``bs``: ``bs`` one round in two, else drawn from
    1 .. bs - 1 (a batch the runners pad to ``bs``)."""
    return bs if bs == 1 or rng.random() < 0.5 else rng.randint(1, bs - 1)


def glue_key_of(runner, bs: int) -> tuple:
    """The key the glue of ``runner`` (a ``dsa_serving.Runner``) holds the prep of ``bs`` under."""
    from sglang_dsa_mtp.integration.dsa_metadata_glue import glue_key

    return (bs,) if runner.op == "draft decode" else glue_key(bs, runner.mode)


def _captured_glue(runner):
    """The ``MetadataGlueGraph`` the backend of ``runner`` captured its keys in, or None."""
    from sglang_dsa_mtp.integration.dsa_metadata_glue import captured_glue
    from sglang_dsa_mtp.integration.state import BackendState, MultiStepState

    kind = MultiStepState if runner.op == "draft decode" else BackendState
    return captured_glue(runner.backend, kind)


def _captured_every_bs(arm, captured) -> list[bool]:
    """Per runner of ``arm``: whether its glue captured every bs of ``captured`` (at the server's
    capture, keyed as the runner's replays find them)."""
    out = []
    for runner in arm.runners.values():
        glue = _captured_glue(runner)
        out.append(
            glue is not None and all(glue.is_captured(glue_key_of(runner, bs)) for bs in captured)
        )
    return out


def _glue_graphs_with_own_pool(arm) -> list[str]:
    """The glue graphs of ``arm`` (on a GPU) whose own memory pool holds a segment, by runner and
    key: a glue graph allocates only in the pool that they all share."""
    held: dict[tuple, int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        held[pool] = held.get(pool, 0) + segment["total_size"]
    out = []
    for runner in arm.runners.values():
        glue = _captured_glue(runner)
        for key, state in [] if glue is None else glue._states.items():  # SGLang's per-key record
            if state["graph"] is not None and held.get(tuple(state["graph"].pool()), 0):
                out.append(f"{runner.op} {key}")
    return out


def arm_glues(arm) -> dict[str, tuple]:
    """Per runner of ``arm``: (the ``MetadataGlueGraph`` its replays go through, or None; its
    ``GlueCounts`` or None). The target verify's is the one its decode runner replays."""
    from sglang_dsa_mtp.integration.dsa_metadata_glue import captured_glue, glue_counts
    from sglang_dsa_mtp.integration.state import BackendState, MultiStepState, RunnerState

    runner = arm.runners["target verify"].decode_runner
    return {
        "target verify": (captured_glue(runner, RunnerState), glue_counts(runner, RunnerState)),
        "draft extend": (
            _captured_glue(arm.runners["draft extend"]),
            glue_counts(arm.extend, BackendState),
        ),
        "draft decode": (
            _captured_glue(arm.runners["draft decode"]),
            glue_counts(arm.multi, MultiStepState),
        ),
    }


def _fallbacks_called(arm) -> dict[str, list]:
    """Per runner of ``arm``, (kernel name, Fallback) of each Fallback its replay calls."""
    from sglang_dsa_mtp.integration.dsa_metadata_selection import KERNELS
    from sglang_dsa_mtp.integration.fallback import fallback_of

    attrs = {name: attr for attr, _, name in KERNELS}
    out = {}
    for op, name in RUNNER_KERNEL.items():
        found = [fallback_of(getattr(b, attrs[name])) for b in arm.runners[op].backends]
        out[op] = [(name, fallback) for fallback in found if fallback is not None]
    return out


def _victims(captured: list[int], rng: random.Random) -> dict:
    """Four distinct captured batch sizes for the injections, by :data:`INJECTIONS` key, none the
    largest (captured first, its capture writes the start-up lines)."""
    pool = sorted(captured)[:-1]
    if len(pool) < len(INJECTIONS):
        raise ValueError(
            f"the injections need {len(INJECTIONS) + 1} captured batch sizes (distinct victims "
            f"below the largest), got {captured}: raise the max bs"
        )
    return dict(zip(INJECTIONS, rng.sample(pool, len(INJECTIONS))))


def run(config: LoopConfig, monkeypatch, progress=None) -> LoopReport:
    """The loop (the module docstring). ``monkeypatch`` carries the stand-ins and injections
    (:func:`~.dsa_serving.prepare` must have run with it); ``progress(line)``, if given, is told
    what each server did as it finishes."""
    sizes = config.sizes
    device = sizes.device
    rng = random.Random(config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    report = LoopReport(device=str(device), context=sizes.context, max_bs=sizes.max_bs)
    pairs = list(config.servers)
    shares = [
        config.rounds // len(pairs) + (i < config.rounds % len(pairs)) for i in range(len(pairs))
    ]
    if config.inject and config.sglang_only:
        raise ValueError("the negative control (sglang_only) runs without injections")
    if config.inject and min(shares) < MIN_ROUNDS_INJECTED:
        raise ValueError(
            f"rounds={config.rounds} gives a server {min(shares)} rounds; with injections each "
            f"needs {MIN_ROUNDS_INJECTED} ({MIN_ROUNDS_INJECTED * len(pairs)} in all)"
        )
    counters = {"on": [], "off": 0, "on capture": 0}
    forward = torch.cuda.Stream() if device.type == "cuda" else None
    if device.type != "cuda":
        from sglang_dsa_mtp.kernels.ops import host

        monkeypatch.setattr(host, "CPU_DEFAULT_BUDGET", config.cpu_budget)
    # The counter's stand-ins (``counting``) are undone when the loop ends: what runs after it in
    # the process (a benchmark's timings) takes the plain path.
    with _plugin_log() as log, monkeypatch.context() as counting:
        forget_all_compiled(device)
        indexer = _IndexerStep(config, monkeypatch, report, rng, gen)
        calls = Calls(counting)
        for (launch_name, seeded), share in zip(pairs, shares):
            # Each server in a process of its own, as it were: its injections undone and its memory
            # freed when it is done, and a fresh once-per-process log memory (the plugin's log keys
            # name objects by id, which a later server's objects may reuse).
            with slice_.launch(launch_name, sizes) as (_, captured), monkeypatch.context() as own:
                own.setattr(plugin_log, "_seen", set())
                victims = _victims(captured, rng) if config.inject else {}
                server = _Server(
                    config, launch_name, seeded, captured, rng, gen, calls=calls, victims=victims
                )
                if config.inject:
                    server.inject_before_capture(own, victims)
                    if config.glue:  # raising in the glue's warm-ups and capture
                        server.inject_at_replay(own, victims)
                        server.arm_in_glue_captures(own)
                if config.sglang_only:
                    server.route_to_sglang(own)
                server.capture(counters)
                server.check_engaged()
                if config.inject and not config.glue:
                    server.inject_at_replay(own, victims)
                start = time.perf_counter()
                # The victims' batch sizes in their own rounds only, the capture's first, the
                # replay injections armed from a third in; the other rounds at the other sizes.
                # The recapture halfway to the arming: the capture's injections raise at both
                # captures, the replay injections after the recapture.
                arm_at = max(2, share // 3)
                recapture_at = arm_at // 2
                forced = {}
                if victims:
                    forced = {0: victims["warm-up"], 1: victims["capture"]}
                    forced.update({arm_at: victims["replay"], arm_at + 1: victims["one launch"]})
                if forward:  # the rounds on a stream of their own, after everything captured
                    torch.cuda.synchronize()
                with torch.cuda.stream(forward) if forward else contextlib.nullcontext():
                    for index in range(share):
                        if index == recapture_at:
                            server.recapture(counters)
                        server.armed = config.inject and not config.glue and index >= arm_at
                        server.round(index, forced.get(index, rng.choice(server.regular)), counters)
                        if indexer.due():
                            indexer.call(server.report.name, counters)
                if forward:
                    torch.cuda.synchronize()
                server.check_fallen_back()
                server.count_glue_eager()
                seconds = server.report.seconds
                seconds["rounds"] = time.perf_counter() - start - seconds.get("recapture", 0)
                report.servers.append(server.report)
                report.injections += server.injections
                if progress is not None:
                    progress(_progress_line(server.report))
                del server
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.injections += indexer.injections
    for injection in report.injections:
        injection.lines = [m for m in log.messages if injection.text in m]
    report.compiles_on = counters["on"]
    report.compiles_off = counters["off"]
    report.compiles_on_capture = counters["on capture"]
    report.calls, report.spanned = dict(calls.launches), dict(calls.spanned)
    report.fell_back, report.credited = dict(calls.fell_back), dict(calls.credited)
    report.bindable, report.bound = dict(calls.bindable), dict(calls.bound)
    return report


def run_plain(
    sizes: slice_.Sizes,
    rounds: int,
    monkeypatch,
    *,
    glue: bool,
    seed: int = 0,
    sglang_only: bool = False,
) -> tuple[ServerReport, Calls]:
    """A server without speculative decoding: its one runner, plain decode
    (:data:`~.dsa_serving.DECODE`), both arms over one ``req_to_token`` capturing every batch size
    SGLang captures, then ``rounds`` rounds as the loop's (a random captured bs, padded one round in
    two, the requests of :class:`Requests` going on one token a round), recaptured a third of the
    way in (``Arm.recapture``). After each capture the host fields are compared, after every
    replay every tensor the graph reads, whole, with the off arm's
    (:func:`~.dsa_serving.differences`); the launches are counted
    (:class:`Calls`): in ``ours["decode"]`` the on arm's replays that launched our decode kernel,
    in ``unexpected`` a replay of either arm that launched what its arm must not, and a compile of
    the on arm after its captures; with ``glue``, the replays its glue served in
    ``glued``; in ``engaged``, the facts that make each arm what it claims. Returns the report and
    the counter (its ``launches``, ``fell_back``, ``bindable`` and ``bound``: the on arm's, by
    kernel). ``sglang_only``: the negative control, every captured bs of the on arm's decode
    Fallback sent to SGLang's kernel before the capture (no launch of ours may be counted).
    ``monkeypatch`` must carry the stand-ins (:func:`~.dsa_serving.prepare`)."""
    from sglang_dsa_mtp.integration.dsa_metadata_glue import glue_counts
    from sglang_dsa_mtp.integration.fallback import fallback_of
    from sglang_dsa_mtp.integration.state import RunnerState

    op, device = slice_.DECODE, sizes.device
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    with monkeypatch.context() as counting, slice_.launch(None, sizes) as (_, captured):
        if device.type != "cuda":
            from sglang_dsa_mtp.kernels.ops import host

            counting.setattr(host, "CPU_DEFAULT_BUDGET", LoopConfig.cpu_budget)
        forget_all_compiled(device)
        calls = Calls(counting)
        req_to_token = torch.zeros(sizes.pool, sizes.context + 5, dtype=torch.int32, device=device)
        common = dict(sizes=sizes, tokens=1, req_to_token=req_to_token, seeded=False)
        on_env = slice_.ON if glue else {**slice_.ON, slice_.GLUE_ENV: "0"}
        on = slice_.Arm("plugin on", on_env, **common)
        kernels = slice_.sglang_metadata_kernels(device)
        off = slice_.Arm("plugin off", slice_.OFF, kernels=kernels, **common)
        for arm in (on, off):
            calls.attach(arm)
        fallback = fallback_of(on.target._fused_decode_metadata)
        if sglang_only and fallback is not None:  # before the capture: a glue captures it so
            fallback.failed.update(captured)
        report = ServerReport(name="no speculative decoding", captured=sorted(captured))
        report.replays, report.batch_sizes, report.padded = {op: 0}, {op: {}}, {op: 0}
        report.ours, report.glued = {"decode": 0}, {op: 0} if glue else {}
        requests = Requests(sizes, req_to_token, rng, gen)
        compiles = {"on capture": 0, "off": 0}

        def capture(again: bool) -> None:
            compiled, differing = capture_arms(on, off, captured, again=again)
            compiles["on capture"] += compiled
            when = ", after the recapture" if again else ""
            report.mismatches += [f"{report.name}, capture{when}, {d}" for d in differing]
            facts = {
                "on: the target has the bounded kernels": fallback is not None,
                "off: the target has SGLang's kernels": (
                    fallback_of(off.target._fused_decode_metadata) is None
                ),
                "on: every bs captured in the glue": _captured_every_bs(on, captured) == [glue],
                "off: no bs captured in a glue": _captured_every_bs(off, captured) == [False],
            }
            report.engaged.update({fact + when: ok for fact, ok in facts.items()})

        capture(again=False)
        forward = torch.cuda.Stream() if device.type == "cuda" else None
        if forward:
            torch.cuda.synchronize()
        with torch.cuda.stream(forward) if forward else contextlib.nullcontext():
            for index in range(rounds):
                if index == rounds // 3:
                    capture(again=True)
                    report.recaptured_after = index
                bs = rng.choice(captured)
                raw_bs = raw_batch_size(bs, rng)
                slots, lengths = requests.batch(raw_bs)
                odd = index % 2 == 1
                slot_t = slice_.request_tensor(slots, device, odd=odd)
                length_t = slice_.request_tensor(lengths, device, odd=odd)
                for arm in (on, off):
                    arm.runners[op].poison(bs, POISON)
                glued = calls.glue_replays
                label = f"round {index}, bs {bs} (raw {raw_bs})"
                with count_compiles() as compiled, calls.replay("on") as (ran, fell_back):
                    on.replay(op, bs, length_t, slot_t)
                if glue:
                    report.glued[op] += calls.glue_replays - glued
                if compiled.names:
                    report.unexpected.append(f"{label}: the on arm compiled {compiled.names}")
                with count_compiles() as compiled, calls.replay("off") as (ran_off, _):
                    off.replay(op, bs, length_t, slot_t)
                compiles["off"] += len(compiled.names)
                if ran_off:
                    report.unexpected.append(f"{label}: the off arm ran ours: {dict(ran_off)}")
                if ran["decode"] > 1 or fell_back["decode"] > 1 or set(ran) - {"decode"}:
                    report.unexpected.append(f"{label}: launches {dict(ran)}, {dict(fell_back)}")
                report.ours["decode"] += ran["decode"] == 1
                report.replays[op] += 1
                report.batch_sizes[op][bs] = report.batch_sizes[op].get(bs, 0) + 1
                report.padded[op] += raw_bs < bs
                for name, differs in slice_.differences(on.runners[op], off.runners[op], bs):
                    report.comparisons += 1
                    if bool(differs):
                        note_mismatch(
                            report, f"{label}: {name}", on.runners[op], off.runners[op], bs, name
                        )
                report.rounds += 1
                report.requests += raw_bs
                report.long_requests += sum(n > sizes.long_from for n in lengths)
                requests.advance(slots, [1] * raw_bs, 1)
        if forward:
            torch.cuda.synchronize()
        if device.type == "cuda":  # the counter's positive controls, as the loop's
            report.engaged["on: its captures compiled (the counter counts)"] = bool(
                compiles["on capture"]
            )
            report.engaged["off: it compiled while serving"] = bool(compiles["off"])
        counts = glue_counts(on.runners[op].decode_runner, RunnerState)
        if glue and counts is not None:
            report.glue_eager[op] = dict(counts.eager)
    return report, calls


def engagement_table(report: LoopReport) -> str:
    """A markdown table: per server, the plugin-on replays of each ENGAGED op that ran ours; then
    the launches of each kernel of ours (:class:`Calls`), those with more live tiles than tile
    programs, the runs of SGLang's kernel behind our Fallbacks, the launches at a bs no injection
    routes that a bound launch took, and the indexer calls the live copy answered."""
    from support.bench_cli import markdown_header, markdown_row

    lines = [markdown_header(["server", *(f"{op}: ours ran" for op in ENGAGED)])]
    for server in report.servers:
        cells = ["{} of {}".format(*server.ours_of(op)) for op in ENGAGED]
        lines.append(markdown_row([server.name, *cells]))
    launches = ", ".join(
        f"{kernel} {report.calls[kernel]:,} ({report.spanned.get(kernel, 0):,} with more live "
        "tiles than programs)"
        for kernel in sorted(report.calls)
    )
    fell_back = ", ".join(f"{k} {n:,}" for k, n in sorted(report.fell_back.items()))
    bound = ", ".join(
        f"{op} {report.bound.get(op, 0):,} of {report.bindable[op]:,}"
        for op in BOUND
        if op in report.bindable
    )
    lines += [
        "",
        f"Launches of ours while the plugin-on arm replayed: {launches or 'none'}; SGLang's "
        f"kernel behind our Fallbacks: {fell_back or 'none'}; launches "
        f"the bound launches took: {bound or 'none'}; indexer calls the live copy "
        f"answered: {report.indexer_live_calls} of {report.indexer_calls}",
    ]
    return "\n".join(lines)


def glue_table(report: LoopReport) -> str:
    """A markdown table: per server and runner, the plugin-on replays its metadata glue served as
    one graph launch (of its replays), and its eager preps by reason."""
    from support.bench_cli import markdown_header, markdown_row

    lines = [markdown_header(["server", *(f"{op}: glued" for op in slice_.OPS)])]
    for server in report.servers:
        cells = []
        for op in slice_.OPS:
            eager = server.glue_eager.get(op) or {}
            why = "; ".join(f"{n} eager: {reason}" for reason, n in eager.items())
            cells.append(
                f"{server.glued.get(op, 0)} of {server.replays[op]}" + (f" ({why})" if why else "")
            )
        lines.append(markdown_row([server.name, *cells]))
    return "\n".join(lines)


def batch_size_table(report: LoopReport) -> str:
    """A markdown table: per server and runner, the captured batch sizes its plugin-on replays ran
    at (of those captured) and its replays of a padded batch (of its replays)."""
    from support.bench_cli import markdown_header, markdown_row

    lines = [markdown_header(["server", *(f"{op}: bs run, padded" for op in slice_.OPS)])]
    for server in report.servers:
        cells = [_batch_sizes_run(server, op) for op in slice_.OPS]
        lines.append(markdown_row([server.name, *cells]))
    return "\n".join(lines)


def _batch_sizes_run(server: ServerReport, op: str) -> str:
    return (
        f"{len(server.batch_sizes[op])} of {len(server.captured)} bs, "
        f"{server.padded[op]} of {server.replays[op]} padded"
    )


def _progress_line(server: ServerReport) -> str:
    seconds = ", ".join(f"{k} {v:.1f} s" for k, v in server.seconds.items())
    return (
        f"{server.name}: {server.rounds} rounds, {sum(server.replays.values())} replays per arm, "
        f"{len(server.mismatches)} mismatches, {_batch_sizes_run(server, 'target verify')} "
        f"({seconds})"
    )


class _IndexerStep:
    """The loop's indexer calls (:class:`IndexerCalls`), every ``indexer_every`` rounds; the live
    copy's failure injected once, at the last call (after it, SGLang's path takes the calls of
    that shape), after calls it answered. The plugin's memory of shapes that failed starts empty."""

    def __init__(self, config: LoopConfig, monkeypatch, report: LoopReport, rng, gen):
        from sglang_dsa_mtp.integration import dsa_indexer_live_logits
        from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live

        self.every, self.inject_ok = config.indexer_every, config.inject
        self.monkeypatch, self.report, self.rng = monkeypatch, report, rng
        self.injections: list[Injection] = []
        self.rounds = 0
        self.last = config.rounds // self.every * self.every if self.every else 0
        self.calls = None
        monkeypatch.setattr(dsa_indexer_live_logits, "_FAILED", {})
        if self.every:
            try:
                self.calls = IndexerCalls(monkeypatch, config.sizes.device, gen)
            except Exception as exc:  # the harness's own failure: reported, the loop goes on
                self._broken("building SGLang's Indexer", exc)
        answered = live.chunked_paged_mqa_logits_live

        def counted(*args, **kwargs):
            out = answered(*args, **kwargs)
            report.indexer_live_calls += 1
            return out

        monkeypatch.setattr(live, "chunked_paged_mqa_logits_live", counted)

    def _broken(self, what: str, exc: Exception) -> None:
        self.report.errors.append(f"the indexer step failed {what}: {type(exc).__name__}: {exc}")
        self.calls = None

    def due(self) -> bool:
        """Whether the loop's next round (counted over all servers) ends with an indexer call."""
        self.rounds += 1
        return self.calls is not None and self.rounds % self.every == 0

    def call(self, server: str, counters: dict) -> None:
        if self.inject_ok and self.rounds == self.last and self.report.indexer_live_calls:
            self.injections.append(_inject_indexer(self.monkeypatch))
        try:
            with count_compiles() as compiled:
                differs = self.calls.call(self.rng)
        except Exception as exc:  # the harness's own failure: reported, the loop goes on
            self._broken("calling it", exc)
            return
        counters["on"] += compiled.names
        self.report.indexer_calls += 1
        if differs:
            self.report.indexer_mismatches.append(f"{server}: {differs}")


def _inject_indexer(monkeypatch) -> Injection:
    """The live copy raising at the second chunk's launch of the next call."""
    from sglang_dsa_mtp.kernels.ops.attention import dsa_paged_mqa_logits_live as live

    injection = Injection(
        where="indexer", what="live copy, second chunk", text="injected at the indexer: live copy"
    )
    launch, launches = live._launch_copy, []

    def second_launch_raises(*args):
        launches.append(args)
        if len(launches) == 2:
            injection.raised += 1
            raise RuntimeError(injection.text)
        return launch(*args)

    monkeypatch.setattr(live, "_launch_copy", second_launch_raises)
    return injection
