"""The one list of keys skylift accepts without effect, and the warning when one is set.

Every other key of the schema changes what a run does (``tests/unit/test_config_liveness.py``
checks that the code reads each of them). The keys here exist only so that the seed's command lines
and config files parse unchanged (its keys outside the schema are its config dialect's,
`skylift.config.dialects`); their fields in ``schema.py`` say so in their help text. Setting
one to anything but its default logs a warning naming the key and why it does nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from skylift.config.schema import SkyliftConfig

logger = logging.getLogger("skylift.config")

#: dotted key -> why it has no effect in skylift.
WITHOUT_EFFECT: dict[str, str] = {
    "trainer.strategy": "FSDP2 is skylift's only training strategy (other values are rejected)",
    "generator.backend": "vLLM is skylift's only inference backend (other values are rejected)",
    "generator.async_engine": "skylift's local engines always run vLLM's async engine",
    "generator.sampling_params.logprobs": (
        "rollouts always carry the sampled token's logprob and never top-k alternatives"
    ),
    "generator.eval_sampling_params.logprobs": "evaluation requests never return logprobs",
}

NO_EFFECT_HELP = "accepted for compatibility, no effect in skylift"
"""The words every help text of a key in `WITHOUT_EFFECT` starts with."""


def lookup(cfg: Any, key: str) -> Any:
    """The value of a dotted key in a config tree."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def keys_set_without_effect(cfg: SkyliftConfig) -> list[str]:
    """The keys of `WITHOUT_EFFECT` whose value in `cfg` differs from the default."""
    default = SkyliftConfig()
    return [key for key in WITHOUT_EFFECT if lookup(cfg, key) != lookup(default, key)]


def warn_without_effect(cfg: SkyliftConfig) -> list[str]:
    """Log one warning per key of `WITHOUT_EFFECT` set to a non-default value; returns those keys."""
    keys = keys_set_without_effect(cfg)
    for key in keys:
        logger.warning("%s=%r has no effect: %s", key, lookup(cfg, key), WITHOUT_EFFECT[key])
    return keys
