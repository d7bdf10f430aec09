"""What ``python -m sglang_dsa_mtp`` reports about this machine, as rows of text.

Whether SGLang is a tested version and its plugin loader finds this package, the kill switches, and
per change whether it would engage here and why not, from what one process can know before a server
starts (the switches, the platform, the environment); the server's own arguments decide the rest,
which the rows name. The hook sites decide again, on the real objects, and log what they decided.
"""

from __future__ import annotations

import torch
from sglang.srt.environ import envs

from sglang_dsa_mtp import devices, plugin
from sglang_dsa_mtp.kernels.ops import launch
from sglang_dsa_mtp.switches import BOUNDED_REPLAY_METADATA, LIVE_WIDTH, SWITCHES

EAGLE_DRAFT_TOKENS = {"3/1/4": 4, "4/1/5": 5, "5/1/6": 6}  # EAGLE steps/topk/draft tokens
Row = tuple[str, ...]
UNRESOLVED = (
    "Hook targets not imported (--no-checks): a feature that engages here still needs each of its "
    "SGLang targets to resolve, which the server checks at start and logs."
)


def installation_rows(device_note: str) -> tuple[list[Row], bool]:
    """(the SGLang, plugin loader, device and launches rows, whether SGLang's loader loads this
    plugin). The launches row says how the bounded kernels' replays launch
    (``launch.launch_path``); without CUDA none engages (and the interpreter compiles nothing)."""
    version = plugin.sglang_version()
    if version is None:
        version_note = "not installed"
    elif plugin.version_tested(version):
        version_note = f"{version} (tested)"
    else:
        version_note = f"{version} (NOT tested; tested: {', '.join(plugin.TESTED_SGLANG_VERSIONS)})"
    discovered, discovery_note = plugin.discovery()
    launches = launch.launch_path()
    if blocker := devices.cuda_blocker():
        launches = f"not used here, {blocker}; on CUDA: {launches}"
    rows = [
        ("SGLang", version_note),
        ("plugin loader", ("yes: " if discovered else "NO: ") + discovery_note),
        ("device", device_note),
        ("launches", launches),
    ]
    return rows, discovered


def switch_rows() -> list[Row]:
    """(variable, on/off, why) per kill switch."""
    rows = []
    for switch in SWITCHES:
        enabled, why = switch.state()
        rows.append((switch.env, "on" if enabled else "off", why))
    return rows


def feature_rows(resolve: bool = True) -> list[Row]:
    """(feature, engages here, why not) per feature: as ``register()`` decided (``resolve=False``:
    without resolving the hook targets, :data:`UNRESOLVED`), and the platform."""
    blocker = devices.cuda_blocker()
    rows = []
    for feature, status in plugin.feature_status(resolve).items():
        why_not = [] if status.enabled else [status.reason]
        if blocker:
            why_not.append(blocker)
        rows.append((feature, "no" if why_not else "yes", "; ".join(why_not)))
    return rows


def first_chunked_requests(num_sms: int, rows_per_request: int) -> int:
    """The fewest running requests whose indexer rows (requests x rows per request) SGLang chunks."""
    return num_sms // rows_per_request + 1


def indexer_engagement(num_sms: int | None, *, sm100: bool = False) -> str:
    """When the live-width indexer logits engage on a GPU of ``num_sms`` SMs (None: no GPU here).

    SGLang chunks the logits of more rows than SMs on its split path: draft extend everywhere, and
    target verify where its context lengths are per row, which is everywhere but SM100, and SM100
    too with ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1`` (there it otherwise takes DeepGEMM's native
    ``[requests, draft tokens]`` path, which chunks by requests, not hooked)."""
    sms = num_sms or devices.H200_SMS
    counts = " / ".join(str(first_chunked_requests(sms, n)) for n in EAGLE_DRAFT_TOKENS.values())
    where = f"this GPU's {sms} SMs" if num_sms else f"the GPU's SMs ({sms} on an H200)"
    if not sm100:
        modes = "target verify and draft extend"
    elif envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.get():
        modes = "target verify and draft extend (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 on SM100)"
    else:
        modes = (
            "draft extend (target verify on SM100 takes DeepGEMM's native path unless "
            "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1)"
        )
    return (
        f"live_width engages where the DSA indexer's logits have more rows than {where}: {modes} "
        f"from {counts} running requests at EAGLE {', '.join(EAGLE_DRAFT_TOKENS)}; decode "
        f"without speculation from {sms + 1}"
    )


def device_indexer_engagement(device: torch.device) -> str:
    """:func:`indexer_engagement` for ``device`` (a CUDA device's SM count and architecture)."""
    if device.type != "cuda":
        return indexer_engagement(None)
    props = torch.cuda.get_device_properties(device)
    return indexer_engagement(props.multi_processor_count, sm100=props.major == 10)


def live_width_rows(resolve: bool = True) -> list[Row]:
    """(part, engages here, when or why not) for each part of the live-width switch; none when
    the switch is set off (``resolve`` as in :func:`feature_rows`). An invalid value, an untested
    SGLang or an unresolved hook is each part's first reason."""
    if LIVE_WIDTH.value_error() is None and not LIVE_WIDTH.state()[0]:
        return []
    status = plugin.feature_status(resolve)[LIVE_WIDTH.feature]
    blockers = []
    if LIVE_WIDTH.value_error() is not None:
        blockers.append("its switch's value is invalid")
    elif not status.enabled:
        blockers.append(status.reason)
    if why := devices.cuda_blocker():
        blockers.append(why)
    topk = [
        f"{name}=0"
        for name in ("SGLANG_DSA_FUSE_TOPK", "SGLANG_OPT_USE_TOPK_V2")
        if not getattr(envs, name).get()
    ]
    one_launch, one_launch_why = BOUNDED_REPLAY_METADATA.state()
    table = "page size > 1, index_kpool 1, no HiSparse, the sgl-kernel top-k backend, index top-k <= 2048"
    parts = [
        (
            "verify mask QLEN_ONLY, not read (target)",
            blockers,
            "EAGLE topk 1 with CUDA graphs; not with --enable-watermark, --enable-two-batch-overlap",
        ),
        (
            "no wide page_table_1: target, draft extend",
            blockers + topk,
            f"speculative decoding; {table}",
        ),
        (
            "no wide page_table_1: MTP draft steps",
            blockers + topk + ([] if one_launch else [one_launch_why]),
            f"as above, and the one-launch path: --speculative-num-steps 2 to 5, {table}",
        ),
        (
            "one real_page_table per backend",
            blockers,
            "wherever a backend keeps its wide page_table_1 (a reader is engaged), page size > 1",
        ),
    ]
    return [
        (part, "no" if why_not else "yes", "; ".join(why_not) if why_not else when)
        for part, why_not, when in parts
    ]
