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

from sglang_dsa_mtp.integration.log import log_once

ACCEPTED = "true/1/yes/y or false/0/no/n (any case)"


@dataclass(frozen=True)
class KillSwitch:
    """One default-on feature switch; ``state()`` re-reads the environment on every call."""

    feature: str
    env: str
    description: str

    @property
    def field(self) -> EnvBool:
        """The switch as an SGLang ``EnvBool``, also reachable as ``envs.<env>``."""
        field = getattr(Envs, self.env, None)
        if field is None:
            field = EnvBool(True)
            field.name = self.env
            setattr(Envs, self.env, field)
        return field

    def state(self) -> tuple[bool, str]:
        """(enabled, why): unset -> on; parsable -> its value; unparsable -> off, logged as an error."""
        raw = os.environ.get(self.env)
        if raw is None:
            return True, "default on"
        try:
            value = self.field.parse(raw)
        except ValueError:
            log_once(
                logging.ERROR,
                ("bad-switch", self.env, raw),
                "%s=%r is not a boolean (accepted: %s); %s stays off",
                self.env,
                raw,
                ACCEPTED,
                self.feature,
            )
            return False, f"{self.env}={raw!r} is not a boolean ({ACCEPTED}): off"
        return value, f"{self.env}={raw}"

    def enabled(self) -> bool:
        return self.state()[0]


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
LIVE_WIDTH = KillSwitch(
    feature="live_width",
    env="SGLANG_DSA_LIVE_WIDTH",
    description="DSA per-round buffers and copies sized by the live KV length, not --context-length",
)
SWITCHES = (BOUNDED_REPLAY_METADATA, DRAFT_ARGMAX_EXCHANGE, LIVE_WIDTH)
