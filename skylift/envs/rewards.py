"""Rule-based answer extraction and reward for GSM8K-style responses (``#### <number>``).

Rules (shared by the ``gsm8k``, ``arithmetic`` and ``arithmetic_multiturn`` environments and by
dataset preparation, which uses `normalize_number` on the reference answers):

- The final answer is the number after the LAST ``####`` marker that is followed by a number
  (whitespace between marker and number is allowed). A ``####`` followed by something that is not a
  number (``#### abc``) does not count; a response without any such ``#### number`` scores 0.
- Before comparing, ``,`` and ``$`` are removed and surrounding whitespace is stripped, so
  ``#### $1,000`` reads as ``1000``.
- Answer and ground truth are compared as exact decimal numbers, so ``72``, ``72.0`` and ``072``
  are all equal; ``72.5`` is not ``72``. No rounding, no tolerance, no units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

ANSWER_MARKER = "####"

# The candidate token after a marker: digits, signs, decimal points, commas and dollar signs.
_CANDIDATE_RE = re.compile(r"####\s*([-$\d.,]+)")
_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def normalize_number(text: str) -> str | None:
    """`text` with ``,``, ``$`` and surrounding whitespace removed if it is a plain decimal number,
    else None. ``" $1,000 "`` -> ``"1000"``; ``"-3.5"`` -> ``"-3.5"``; ``"abc"`` -> None."""
    cleaned = text.replace(",", "").replace("$", "").strip()
    if cleaned.startswith("-"):
        cleaned = "-" + cleaned[1:].strip()
    if not _NUMBER_RE.fullmatch(cleaned):
        return None
    return cleaned


@dataclass(frozen=True)
class ParsedAnswer:
    """What `parse_final_answer` found in a response."""

    found_marker: bool  # the response contains "####" at all
    answer: str | None  # the normalised number after the last "#### number", or None


def parse_final_answer(text: str) -> ParsedAnswer:
    """Find the last ``#### number`` in `text` (see the module docstring for the rules)."""
    answer: str | None = None
    for match in _CANDIDATE_RE.finditer(text):
        # A trailing full stop ends the sentence ("#### 72."), it is not part of the number.
        number = normalize_number(match.group(1).rstrip("."))
        if number is not None:
            answer = number
    return ParsedAnswer(found_marker=ANSWER_MARKER in text, answer=answer)


def extract_final_answer(text: str) -> str | None:
    """The normalised number after the last ``#### number`` in `text`, or None if there is none."""
    return parse_final_answer(text).answer


def answers_equal(answer: str | None, ground_truth: str) -> bool:
    """True when `answer` and `ground_truth` are the same decimal number (after normalisation)."""
    if answer is None:
        return False
    a, b = normalize_number(answer), normalize_number(str(ground_truth))
    if a is None or b is None:
        return False
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def gsm8k_reward(response: str, ground_truth: str) -> float:
    """1.0 when the last ``#### number`` of `response` equals `ground_truth`, else 0.0."""
    return 1.0 if answers_equal(extract_final_answer(response), ground_truth) else 0.0
