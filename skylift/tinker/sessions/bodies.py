"""The typed JSON bodies of the session routes (see `skylift.tinker.core.bodies`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from tinker import types as sdk

from skylift.tinker.core.bodies import _LENIENT, MAX_ID_CHARS, MAX_TAG_CHARS, MAX_TAGS, Id, Metadata, _Body


class CreateSessionBody(sdk.CreateSessionRequest):
    model_config = _LENIENT
    tags: list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]] = Field(default=[], max_length=MAX_TAGS)
    user_metadata: Metadata | None = None
    sdk_version: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    project_id: Id | None = None
    display_name: Id | None = None


class HeartbeatBody(sdk.SessionHeartbeatRequest):
    model_config = _LENIENT
    session_id: Id


class FinishReason(_Body):
    type: Annotated[str, Field(max_length=64)] = "success"


class FinishSessionBody(_Body):
    reason: FinishReason | None = None
