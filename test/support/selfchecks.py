"""The self-checks ``python -m sglang_dsa_mtp`` runs: each of our kernels against SGLang's own.

Importing this module defines Triton kernels: import it after ``select_device()``.
"""

from sglang_dsa_mtp.selfcheck import SelfCheck
from support.argmax_cases import check_draft_argmax_exchange
from support.indexer_cases import check_live_logits
from support.metadata_cases import (
    check_bounded_replay_metadata,
    check_draft_decode_metadata,
)

CHECKS: tuple[SelfCheck, ...] = (
    SelfCheck("bounded DSA replay metadata", check_bounded_replay_metadata),
    SelfCheck("one-launch MTP draft decode metadata", check_draft_decode_metadata),
    SelfCheck("draft argmax partials + finalize", check_draft_argmax_exchange),
    SelfCheck("live-width indexer logits (chunked)", check_live_logits),
)
