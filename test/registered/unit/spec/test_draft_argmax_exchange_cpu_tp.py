"""The draft argmax exchange in a real two-process TP group, on CPU (gloo), with SGLang's real
``LogitsProcessor`` and vocab-parallel ``ParallelLMHead`` and the plugin's hooks applied by SGLang's
``HookRegistry`` in each process; kernels under Triton's interpreter.

This is the part of the TP test that needs SGLang's runtime (absent where the GPU tests run from the wheel's files):
the exchange off gathers logits bit-identical to the per-shard reference, the opt-in engages on
the group's CPU all-reduce, and the exchange on gives the same tokens, ``topk_p``, positions and
draft tokens as SGLang's pick from the gathered logits (draft decode and draft extend), for plain
heads and for a ModelOpt NVFP4 checkpoint's NextN draft head sharing the target's bf16 weight. The GPU
side (NCCL and symmetric-memory all-reduce, CUDA graphs) is
``kernels/ops/speculative/test_draft_argmax_exchange_tp.py``. The body of each process is
``sglang_dsa_mtp.testing.cpu_tp.exchange_on_off_worker``.
"""

import pytest
import torch

from sglang_dsa_mtp.testing.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp.testing.cpu_tp import exchange_on_off_worker
from sglang_dsa_mtp.testing.process_group import read_reports, run_group

WORLD = 2
OTHER_RANK = "another TP rank keeps the gather (its reason is in its log)"
# What each rank agrees on when only rank 1 objects ("only rank 1 objects"): its own reason there,
# on the other rank the word that another rank keeps the gather.
AGREED = {0: OTHER_RANK, 1: "only rank 1 objects"}
# Each rank's opt-in decision when rank 1's opt-in check raises.
REASON_WHEN_RANK_1_FAILS = {
    0: OTHER_RANK,
    1: "the opt-in check raised RuntimeError: rank 1 cannot tell",
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU (gloo) harness; this machine has CUDA")
def test_logits_processor_exchange_on_and_off_pick_the_same_tokens_in_a_cpu_tp_group(tmp_path):
    run_group(exchange_on_off_worker, WORLD, str(tmp_path), timeout_s=900)
    reports = read_reports(str(tmp_path), WORLD)
    assert [r["rank"] for r in reports] == list(range(WORLD))
    for report in reports:
        where = f"rank {report['rank']}"
        assert report["failures"] == [], where
        assert report["group"] == dict(world_size=WORLD, rank=report["rank"]), where
        assert report["flags"] == dict(
            do_tensor_parallel_all_gather=True,
            use_attn_tp_group=False,
            do_tensor_parallel_all_gather_dp_attn=False,
        ), where
        assert report["shard_width"] == 512, where  # vocab 1001 padded to 1024, two shards
        assert report["route"] == "CPU shared memory or torch.distributed", where
        assert report["agreed"] == AGREED[report["rank"]], f"{where}: rank 1's objection"
        assert report["reason_when_rank_1_fails"] == REASON_WHEN_RANK_1_FAILS[report["rank"]], where
        assert report["engaged_when_rank_1_fails"] is False, where
        assert report["quantized"] == dict(
            checkpoint="modelopt_fp4",
            quant_method="ModelOptFp4LinearMethod",
            weight_dtype="torch.bfloat16",
        ), f"{where}: the NVFP4 draft head keeps its method and takes the target's bf16 weight"
        # (2 dtypes x 2 logit scales + the NVFP4 draft head) x (decode rows 1..5 + draft extend)
        assert report["checked"] == (2 * 2 + 1) * 6, where
        assert [(a["dtype"], a["sum_ok"]) for a in report["all_reduce"]] == [
            ("torch.float32", True),
            ("torch.bfloat16", True),
        ], where
