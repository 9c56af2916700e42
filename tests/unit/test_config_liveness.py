"""Every config key is live: read by the code, or listed once as accepted without effect.

The check walks every leaf of the schema and looks for a read of exactly that key in skylift's
source outside ``skylift/config/`` (validation reads every key, so it does not count), with the
static analysis of ``config_reads.py``: expressions are resolved to schema paths, so an engine's
``params.min_p`` is not mistaken for ``generator.sampling_params.min_p``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from config_reads import Schema, package_sources, read_keys

import skylift
from skylift.config import field_help, load_config
from skylift.config.inert import NO_EFFECT_HELP, WITHOUT_EFFECT, keys_set_without_effect
from skylift.config.schema import SkyliftConfig

PACKAGE = Path(skylift.__file__).parent
# the modules declaring the schema's classes (sampling.py: generator.*sampling_params)
SCHEMA_SOURCE = "\n".join((PACKAGE / "config" / name).read_text() for name in ("schema.py", "sampling.py"))

# Keys whose implementation is landing from another part of issue 14 (Ray placement groups). The
# test below fails as soon as the code reads one, so that it is taken off this list.
PENDING: dict[str, str] = {}


def _sources() -> list[tuple[str, str]]:
    return package_sources(PACKAGE, exclude=("config/",))


@pytest.fixture(scope="module")
def schema() -> Schema:
    return Schema.of(SkyliftConfig)


@pytest.fixture(scope="module")
def read(schema: Schema) -> set[str]:
    return read_keys(schema, _sources(), SCHEMA_SOURCE)


def test_every_key_is_read_or_accepted_without_effect(schema: Schema, read: set[str]) -> None:
    unread = sorted(schema.leaves - read - set(WITHOUT_EFFECT) - set(PENDING))
    assert not unread, (
        f"config keys that no code outside skylift/config reads: {unread}. Implement them, remove "
        "them, or (SkyRL keys accepted only so that SkyRL command lines parse) add them to "
        "skylift.config.inert.WITHOUT_EFFECT"
    )


def test_keys_listed_without_effect_exist_and_are_not_read(schema: Schema, read: set[str]) -> None:
    for key in [*WITHOUT_EFFECT, *PENDING]:
        assert key in schema.leaves, f"{key} is listed but is not a key of the schema"
        assert key not in read, f"{key} is read by the code now: take it off the list"


def test_keys_without_effect_say_so_where_declared() -> None:
    for key in WITHOUT_EFFECT:
        assert field_help(key).startswith(NO_EFFECT_HELP), f"{key}: help must start with {NO_EFFECT_HELP!r}"
        name = key.rsplit(".", 1)[-1]
        declared = re.search(rf"^\s+{name}: .*# accepted without effect", SCHEMA_SOURCE, re.MULTILINE)
        assert declared, f"{key}: its field in schema.py needs a '# accepted without effect' comment"
    others = [k for k in Schema.of(SkyliftConfig).leaves if k not in WITHOUT_EFFECT]
    assert not [k for k in others if NO_EFFECT_HELP in field_help(k)]


def test_setting_a_key_without_effect_warns_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        load_config()
    assert not caplog.records  # defaults warn about nothing
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        cfg = load_config(["generator.async_engine=false", "generator.sampling_params.logprobs=1"])
    messages = [r.getMessage() for r in caplog.records]
    assert keys_set_without_effect(cfg) == [
        "generator.async_engine",
        "generator.sampling_params.logprobs",
    ]
    assert len(messages) == 2
    assert messages[0].startswith("generator.async_engine=False has no effect: ")
    assert "generator.sampling_params.logprobs=1 has no effect" in messages[1]


# ------------------------------------------------------------------------------ the check itself


@dataclass
class _Sampling:
    temperature: float = 1.0
    min_p: float = 0.0


@dataclass
class _Root:
    sampling: _Sampling = field(default_factory=_Sampling)
    unused_knob: int = 0


_TOY_SOURCE = """
from skylift.config.schema import _Root, _Sampling
from skylift.inference.types import SamplingParams

def build(cfg: _Root, params: SamplingParams) -> dict:
    sp = cfg.sampling
    return {"temperature": sp.temperature, "engine_min_p": params.min_p, "unused_knob": 0}
"""


def test_the_check_reports_a_field_nobody_reads() -> None:
    toy = Schema.of(_Root)
    read = read_keys(toy, [("toy.py", _TOY_SOURCE)])
    # sp.temperature resolves to sampling.temperature; the engine's params.min_p and a string
    # "unused_knob" are not reads of the config
    assert read == {"sampling.temperature"}
    assert toy.leaves - read == {"sampling.min_p", "unused_knob"}


def test_the_check_follows_assignments_methods_and_getattr_loops() -> None:
    source = """
from skylift.config import load_config
from skylift.config.schema import OptimizerConfig

def settings(o: OptimizerConfig) -> float:
    return o.lr

class Trainer:
    def __init__(self, overrides):
        self.cfg = load_config(overrides)

    def run(self):
        t, g = self.cfg.trainer, self.cfg.generator
        world = t.policy_world_size()
        for name in ("seed", "epochs"):
            getattr(t, name)
        sp = g.eval_sampling_params if world else g.sampling_params
        return sp.top_k
"""
    schema = Schema.of(SkyliftConfig)
    read = read_keys(schema, [("toy.py", source)], SCHEMA_SOURCE)
    assert read == {
        "trainer.policy.optimizer_config.lr",
        "trainer.critic.optimizer_config.lr",
        "trainer.placement.policy_num_nodes",
        "trainer.placement.policy_num_gpus_per_node",
        "trainer.seed",
        "trainer.epochs",
        "generator.sampling_params.top_k",
        "generator.eval_sampling_params.top_k",
    }


def test_the_check_fails_when_the_code_stops_reading_a_key(schema: Schema, read: set[str]) -> None:
    """Drop the line that hands min_p to the engines: the key is reported unread."""
    reads_min_p = re.compile(r"^\s*min_p=\w+\.min_p,\s*$", re.MULTILINE)
    sources = _sources()
    assert any(reads_min_p.search(text) for _, text in sources)
    without = [(name, reads_min_p.sub("", text)) for name, text in sources]
    unread = schema.leaves - read_keys(schema, without, SCHEMA_SOURCE)
    assert "generator.sampling_params.min_p" in read
    assert {"generator.sampling_params.min_p", "generator.eval_sampling_params.min_p"} <= unread


def test_the_check_reads_through_a_protocol_a_group_satisfies() -> None:
    """A lower layer declares what it reads of a group as a Protocol (it cannot import the config):
    a name annotated with it holds the paths of every schema class having all its members."""
    source = """
from typing import Protocol

class Temperature(Protocol):
    temperature: float

class Unrelated(Protocol):
    temperature: float
    def sample(self) -> int: ...

def scale(logits, s: Temperature, u: Unrelated) -> float:
    return logits / s.temperature + u.temperature
"""
    toy = Schema.of(_Root)
    assert read_keys(toy, [("toy.py", source)]) == {"sampling.temperature"}
