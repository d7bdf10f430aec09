"""The kill switches, parsed with SGLang's ``EnvBool`` rules but strict on bad values.

SGLang's ``EnvField.get()`` falls back to the default on an unparsable value; for a default-on switch
that would keep a feature on that the user meant to turn off (``=off``). Here an unparsable value is
logged as an error naming the variable and the accepted values, and the feature stays off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from sglang.srt.environ import EnvBool, Envs

from sglang_dsa_mtp import devices
from sglang_dsa_mtp.log import log_once

ACCEPTED = "true/1/yes/y or false/0/no/n (any case)"


@dataclass(frozen=True)
class KillSwitch:
    """One feature switch, on by default unless ``default`` says otherwise (a feature whose proof is
    not complete is opt-in); ``state()`` re-reads the environment on every call."""

    feature: str
    env: str
    description: str
    default: bool = True

    @property
    def field(self) -> EnvBool:
        """The switch as an SGLang ``EnvBool``, also reachable as ``envs.<env>``."""
        field = getattr(Envs, self.env, None)
        if field is None:
            field = EnvBool(self.default)
            field.name = self.env
            setattr(Envs, self.env, field)
        return field

    def _parse(self, raw: str) -> tuple[bool, str | None]:
        """(value, None) for one of SGLang's boolean words; (False, why) for anything else."""
        try:
            return self.field.parse(raw), None
        except ValueError:
            return False, f"{self.env}={raw!r} is not a boolean ({ACCEPTED})"

    def value_error(self) -> str | None:
        """Why the environment's value of this switch is invalid; None when it is unset or valid."""
        raw = os.environ.get(self.env)
        return None if raw is None else self._parse(raw)[1]

    def state(self) -> tuple[bool, str]:
        """(enabled, why): unset -> its default; parsable -> its value; unparsable -> off, logged as
        an error the first time (the one message naming the value and the accepted ones; ``why``
        points to it)."""
        raw = os.environ.get(self.env)
        if raw is None:
            if self.default:
                return True, "default on"
            return False, f"default off ({self.env}=1 turns it on)"
        value, error = self._parse(raw)
        if error is None:
            return value, f"{self.env}={raw}"
        log_once(
            logging.ERROR,
            ("bad-switch", self.env, raw),
            "sglang_dsa_mtp: %s; %s stays off",
            error,
            self.feature,
        )
        return False, f"{self.env} is invalid (see the error)"

    def enabled(self) -> bool:
        return self.state()[0]

    def blocker(self) -> str | None:
        """The gate every hook site asks first: why this switch's changes cannot engage in this
        process (the switch is off, or this is not a CUDA platform), or None when they can."""
        enabled, why = self.state()
        return why if not enabled else devices.cuda_blocker()


BOUNDED_REPLAY_METADATA = KillSwitch(
    feature="bounded_replay_metadata",
    env="SGLANG_DSA_BOUNDED_REPLAY_METADATA",
    description="bounded DSA replay-metadata kernels and the one-launch MTP draft metadata",
)
DRAFT_ARGMAX_EXCHANGE = KillSwitch(
    feature="draft_argmax_exchange",
    env="SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE",
    description="greedy EAGLE drafts exchange vocab-shard argmax partials instead of gathering logits",
)
VERIFY_ARGMAX_EXCHANGE = KillSwitch(
    feature="verify_argmax_exchange",
    env="SGLANG_SPEC_VERIFY_ARGMAX_EXCHANGE",
    description="greedy EAGLE target verify takes its argmax from vocab-shard argmax partials",
)
METADATA_GLUE = KillSwitch(
    feature="metadata_glue",
    env="SGLANG_DSA_METADATA_GLUE",
    description="every DSA graph runner's replay prep, padded replays too, through SGLang's "
    "MetadataGlueGraph: one graph launch per replay",
    # Opt-in: each key's glue graph keeps a private memory pool (docs/switches.md, "Metadata glue").
    default=False,
)
LIVE_WIDTH = KillSwitch(
    feature="live_width",
    env="SGLANG_DSA_LIVE_WIDTH",
    description="DSA per-round buffers and copies sized by the live KV length, not --context-length",
)
SWITCHES = (
    BOUNDED_REPLAY_METADATA,
    DRAFT_ARGMAX_EXCHANGE,
    VERIFY_ARGMAX_EXCHANGE,
    LIVE_WIDTH,
    METADATA_GLUE,
)
