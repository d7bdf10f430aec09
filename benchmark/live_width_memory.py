"""Bytes the DSA backends' CUDA-graph state holds, and the verify tree mask allocated per round,
with ``SGLANG_DSA_LIVE_WIDTH`` on and off, for the spec's launches at a 1M-token context.

No GPU needed (SGLang 0.5.23 installed, on the CPU): the backends are SGLang's real classes, built by
SGLang's own constructors (the target through its attention registry, the draft-extend and
multi-step backends through its ``DraftBackendFactory``) in a published launch
(``support.dsa_backends``), with SGLang's plugin loader having applied this plugin's
hooks. Their graph state comes from SGLang's own ``init_cuda_graph_state``, and every batch size
SGLang captures in spec mode (``generate_decode_cuda_graph_batch_sizes``) gets its metadata from
SGLang's own capture path, all on PyTorch's meta device: full width, real shapes, nothing allocated.
The CUDA-only pieces (DeepGEMM's schedule, the top-k v2 plan, FlashMLA's tile metadata) are small
stand-ins of fixed size, the same in both arms. A backend's bytes are those of the distinct tensors
its graph state holds (``dsa_backends.graph_state_bytes``: views counted once, by their base).

The per-round figure is the tree mask SGLang's EAGLE worker allocates between draft and verify when
the target has no verify mask (SGLang's own ``tree_mask_numel`` for FULL_MASK with ``max_context_len``
for the unknown ``seq_lens_sum``), at the largest batch, against none with the plugin's preallocated
QLEN_ONLY mask (counted in the target's graph state).

    python benchmark/live_width_memory.py            # the table in docs/results.md
    python benchmark/live_width_memory.py --with-reader  # wide tables kept: shared real tables only
    python benchmark/live_width_memory.py --launch 4/1/5 --max-bs 16 --context 1048576
"""

from __future__ import annotations

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))

import argparse
import logging
import os

from sglang_dsa_mtp.devices import select_device
from support.constants import CONTEXT_1M

select_device()  # before any Triton kernel is defined (TRITON_INTERPRET=1 without CUDA)

MB = 1e6


def build_graph_state(server_args, context: int, max_bs: int, switch: str) -> dict[str, int]:
    """Bytes of each backend's graph state for one launch, with the switch at ``switch``."""
    import torch
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_spec

    from sglang_dsa_mtp.switches import LIVE_WIDTH
    from support import dsa_backends as kit

    os.environ[LIVE_WIDTH.env] = switch
    spec = get_spec()
    tokens, steps = spec.speculative_num_draft_tokens, spec.speculative_num_steps
    captured = sorted(generate_decode_cuda_graph_batch_sizes(server_args, max_bs), reverse=True)
    req_to_token = torch.empty(max_bs + 1, context + 4 + tokens, dtype=torch.int32, device="meta")
    common = dict(context_len=context, req_to_token=req_to_token, device="meta")
    target = kit.target_backend(kit.model_runner(**common))
    extend, multi = kit.draft_backends(kit.model_runner(is_draft=True, **common))
    target.init_cuda_graph_state(max_bs, max_bs * tokens)
    extend.init_cuda_graph_state(max_bs, max_bs * tokens)
    multi.init_cuda_graph_state(max_bs, max_bs)
    for bs in captured:
        kit.capture(target, bs, ForwardMode.TARGET_VERIFY)
        kit.capture(extend, bs, ForwardMode.DRAFT_EXTEND_V2)
        kit.capture(multi, bs, ForwardMode.DECODE)
    out = {"target (verify)": kit.graph_state_bytes(target)}
    out["draft extend"] = kit.graph_state_bytes(extend)
    out[f"draft steps ({steps - 1})"] = sum(kit.graph_state_bytes(b) for b in multi.attn_backends)
    out["_captured"] = captured
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--launch",
        nargs="+",
        default=["4/1/5", "5/1/6"],
        help="EAGLE steps/topk/draft tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--max-bs",
        nargs="+",
        type=int,
        default=[16, 48],
        help="largest captured batch size = --max-running-requests (default: %(default)s)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=CONTEXT_1M,
        help="--context-length (default: %(default)s, the spec's 1M tokens)",
    )
    parser.add_argument(
        "--with-reader",
        action="store_true",
        help="engage a reader of page_table_1 (top-k v2 off: SGLANG_OPT_USE_TOPK_V2=0), so that every "
        "backend keeps its wide table and only the shared real_page_table applies",
    )
    args = parser.parse_args()
    if args.with_reader:
        os.environ["SGLANG_OPT_USE_TOPK_V2"] = "0"

    import pytest
    import sglang.srt.plugins
    from sglang.srt.layers.attention.verify_mask import tree_mask_numel
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    from sglang_dsa_mtp.plugin import ENTRY_POINT
    from support import dsa_backends as kit

    os.environ["SGLANG_PLUGINS"] = ENTRY_POINT
    sglang.srt.plugins.load_plugins()
    # The meta device runs no kernel: each captured batch size's warm-up fails there and logs its
    # fallback, which allocates nothing. The plugin's lines would bury the table.
    logging.getLogger("sglang_dsa_mtp").disabled = True
    rows = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        kit.set_platform(monkeypatch, cuda=True, hip=False)
        kit.cuda_stand_ins(monkeypatch)
        for launch in args.launch:
            for max_bs in args.max_bs:
                fields = dict(max_running_requests=max_bs, cuda_graph_max_bs_decode=max_bs)
                with kit.serving(launch, **fields) as server_args:
                    off = build_graph_state(server_args, args.context, max_bs, "0")
                    on = build_graph_state(server_args, args.context, max_bs, "1")
                tokens = kit.LAUNCHES[launch][2]
                mask = tree_mask_numel(TreeMaskMode.FULL_MASK, max_bs, tokens, args.context)
                rows.append((launch, max_bs, off, on, mask))

    reader = "; SGLANG_OPT_USE_TOPK_V2=0 (a reader of page_table_1)" if args.with_reader else ""
    print(f"context {args.context} tokens; MB = 1e6 bytes{reader}\n")
    print(
        "| EAGLE | max bs | backend | graph state, switch off (MB) | switch on (MB) | saved (MB) |"
    )
    print("|---|---|---|---|---|---|")
    for launch, max_bs, off, on, mask in rows:
        names = [name for name in off if not name.startswith("_")]
        for name in names:
            print(
                f"| {launch} | {max_bs} | {name} | {off[name] / MB:,.1f} | {on[name] / MB:,.1f} "
                f"| {(off[name] - on[name]) / MB:,.1f} |"
            )
        total_off, total_on = sum(off[n] for n in names), sum(on[n] for n in names)
        print(
            f"| {launch} | {max_bs} | **all, per GPU** | {total_off / MB:,.1f} | "
            f"{total_on / MB:,.1f} | **{(total_off - total_on) / MB:,.1f}** |"
        )
    print("\n| EAGLE | max bs | tree mask per verify round at bs = max bs, switch off (MB) | on |")
    print("|---|---|---|---|")
    for launch, max_bs, _, _, mask in rows:
        print(f"| {launch} | {max_bs} | {mask / MB:,.1f} | 0 |")
    print()
    for launch, max_bs, off, _, _ in rows:
        print(f"EAGLE {launch}, max bs {max_bs}: captured batch sizes {sorted(off['_captured'])}")


if __name__ == "__main__":
    main()
