"""Reading integer fields of JSON request bodies: a wrong type or a value out of range is a
`UserError` naming the field and its range (never an OverflowError or a huge id)."""

from __future__ import annotations

from typing import Any

from skylift.tinker.errors import UserError

#: Sequence ids (model_seq_id, sampling_session_seq_id, seq_id) are 32-bit on the SDK's side.
MAX_SEQ_ID = 2**31 - 1


def int_field(
    body: dict[str, Any], key: str, default: int, lowest: int = 0, highest: int = MAX_SEQ_ID
) -> int:
    """`body[key]` (`default` when missing or null) as an integer in [lowest, highest]."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, str):  # "3" is 3; "first" raises ValueError: a malformed request (400)
        value = int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= highest:
        raise UserError(f"{key} must be an integer in [{lowest}, {highest}], got {value!r}")
    return value
