"""The draft argmax exchange in a real TP group: one process per visible GPU, torch.distributed NCCL.

What runs where: this module needs two or more CUDA GPUs (2 GPUs: TP 2; 4 or 8 GPUs give TP 4 or 8,
the TP size follows ``torch.cuda.device_count()``) and only torch, triton, this package
and SGLang 0.5.23's files (for ``draft_topk1_postprocess``, loaded by file path). SGLang's own
``LogitsProcessor`` forward with the exchange on and off needs SGLang's dependencies, which a GPU
machine set up from the wheel (``test/gpu_env.sh``) lacks; that part is tested in a CPU process
group where SGLang imports.

Each rank (``sglang_dsa_mtp.testing.gpu_tp.exchange_tp_worker``): a real bf16 LM-head GEMM of shared random hidden
states (hidden 6144) against its own weight shard, for vocab 154880, 129281 and 1001 (SGLang's padded
shards; the padded columns hold +inf / NaN / 1e30 and the rows carry the hard patterns), rows 1..16:

* partials, the sum all-reduce, finalize with both NaN policies;
* the all-reduce is exact: it equals every rank's pre-reduce buffer (all-gathered) summed locally in
  rank order, reversed, shuffled and pairwise;
* tokens, topk_p, positions and draft tokens equal SGLang's gathered path on the all-gathered logits
  (``draft_topk1_postprocess``; ``torch.argmax`` for ``propagate``);
* the whole step (GEMM + partials + all-reduce + both finalizes) captured in a CUDA graph at rows 1,
  5 and 16 and replayed with new hidden states, each replay checked the same way.

Two all-reduces: NCCL through ``torch.distributed.all_reduce``, and torch symmetric memory's
one-shot all-reduce (P2P, no multicast). The symmetric-memory arm is skipped, with the reason, only
where it cannot exist (``gpu_tp.symm_mem_unavailable``: a torch without the op, or GPUs without P2P
access to each other); any other error setting it up fails the test.
Environment settings such as NCCL_NVLS_ENABLE=0 or TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are left as they
are.
"""

import pytest
import torch

from sglang_dsa_mtp.testing.gpu_tp import exchange_tp_worker
from sglang_dsa_mtp.testing.process_group import read_reports, run_group

pytestmark = pytest.mark.gpu


def tp_size() -> int:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs at least 2 CUDA GPUs for a real TP group, found {count}")
    return count


@pytest.mark.parametrize("comm", ["nccl", "symm_mem"])
def test_exchange_in_a_real_tp_group(comm, tmp_path):
    world = tp_size()
    run_group(exchange_tp_worker, world, str(tmp_path), comm, timeout_s=900)
    reports = read_reports(str(tmp_path), world)
    assert len(reports) == world, f"only {len(reports)} of {world} ranks reported"
    skipped = sorted({r["skipped"] for r in reports if r.get("skipped")})
    if skipped:
        assert comm == "symm_mem", skipped
        pytest.skip("; ".join(skipped))
    for report in reports:
        assert not report["failures"], report["failures"]
        # 3 vocabs x (16 eager row counts + 3 graph row counts x 3 replays)
        assert report["checked"] == 3 * (16 + 3 * 3), report
