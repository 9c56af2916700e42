"""Stability records of sampled sequences and the provenance spans that name them.

A sampler created with ``record_stability_info=True`` records, for every sequence it returns, the
sampled tokens, the logprobs the engine sampled them with and the distribution it sampled from
(temperature, top-k, top-p), under the sequence's ``sequence_id``. A training datum names them with provenance spans (``Datum.with_provenance``):
runs that tile its ``loss_fn_inputs`` positions, each either prompt tokens of a request or sampled
tokens of a sequence. `resolve` turns the spans of a ``stable_reinforce`` datum into two
per-position inputs: the recorded logprobs and a mask of the sampled positions.

Records belong to the session that sampled them and live for `ttl_s` after their last use (the
SDK documents one day); at most `max_tokens` tokens are kept (oldest use dropped first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from skylift.algorithms.sample_support import TokenDistribution
from skylift.tinker.core.auth import current_user
from skylift.tinker.errors import UserError

DAY_S = 86400.0
UNTRUNCATED = TokenDistribution()


@dataclass(frozen=True)
class Span:
    """One provenance run: `length` positions of sequence `sequence_id`'s prompt or sampled tokens."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Record:
    session_id: str
    tokens: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    used_at: float
    sampling: TokenDistribution = UNTRUNCATED
    owner: str | None = None


class StabilityRecords:
    """Sampled sequences by sequence id, bounded in tokens and time; each user's records within
    its own share (`max_tokens_per_user`, its oldest dropped first), so that one user's sampling
    never pushes out another's records before the global bound does."""

    def __init__(
        self, ttl_s: float = DAY_S, max_tokens: int = 20_000_000, max_tokens_per_user: int | None = None
    ) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.max_tokens_per_user = max_tokens_per_user
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._tokens = 0
        self._by_owner: dict[str | None, OrderedDict[str, None]] = {}  # owner -> its ids, oldest first
        self._owner_tokens: dict[str | None, int] = {}

    def tokens_of(self, owner: str | None) -> int:
        return self._owner_tokens.get(owner, 0)

    def __len__(self) -> int:
        return len(self._records)

    def add(
        self,
        sequence_id: str,
        session_id: str,
        tokens: list[int],
        logprobs: list[float] | None,
        sampling: TokenDistribution = UNTRUNCATED,
    ) -> None:
        if logprobs is None or len(logprobs) != len(tokens):
            raise UserError(f"sequence {sequence_id}: the engine returned no logprobs to record")
        record = Record(
            session_id=session_id,
            tokens=np.asarray(tokens, dtype=np.int64),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            used_at=time.monotonic(),
            sampling=sampling,
            owner=current_user.get(),
        )
        self._drop(sequence_id)
        self._records[sequence_id] = record
        self._tokens += len(tokens)
        self._by_owner.setdefault(record.owner, OrderedDict())[sequence_id] = None
        self._owner_tokens[record.owner] = self.tokens_of(record.owner) + len(tokens)
        mine = self._by_owner[record.owner]
        while (
            self.max_tokens_per_user is not None and self.tokens_of(record.owner) > self.max_tokens_per_user
        ):
            self._drop(next(iter(mine)))
        self._expire()

    def _drop(self, sequence_id: str) -> None:
        old = self._records.pop(sequence_id, None)
        if old is not None:
            self._tokens -= len(old.tokens)
            self._owner_tokens[old.owner] = self.tokens_of(old.owner) - len(old.tokens)
            self._by_owner.get(old.owner, OrderedDict()).pop(sequence_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._records:
            sequence_id, oldest = next(iter(self._records.items()))
            if self._tokens <= self.max_tokens and now - oldest.used_at <= self.ttl_s:
                break
            self._drop(sequence_id)

    def get(self, sequence_id: str, session_id: str) -> Record:
        """The record of `sequence_id` (which restarts its time to live)."""
        self._expire()
        record = self._records.get(sequence_id)
        if record is None or record.session_id != session_id:
            raise UserError(
                f"sequence {sequence_id!r} has no stability record in this session: sample it with "
                "record_stability_info=True (records expire one day after their last use)"
            )
        record.used_at = time.monotonic()
        self._records.move_to_end(sequence_id)
        self._by_owner.get(record.owner, OrderedDict()).pop(sequence_id, None)
        self._by_owner.setdefault(record.owner, OrderedDict())[sequence_id] = None
        return record

    def sampling_of(self, spans: list[list[Span] | None], session_id: str) -> set[TokenDistribution] | None:
        """The distributions the sampled spans of several data were recorded with; None when a
        datum has no spans or a sampled span names no record of `session_id`."""
        found: set[TokenDistribution] = set()
        for datum_spans in spans:
            if not datum_spans:
                return None
            for span in datum_spans:
                if not span.sampled or not span.length:
                    continue
                record = self._records.get(span.sequence_id)
                if record is None or record.session_id != session_id:
                    return None
                found.add(record.sampling)
        return found

    def resolve(
        self,
        spans: list[Span],
        targets: np.ndarray,
        advantages: np.ndarray,
        session_id: str,
        where: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(recorded logprobs, sampled mask), both float32 `[n]`, of a datum's loss positions."""
        n = int(targets.shape[0])
        total = sum(s.length for s in spans)
        if total != n:
            raise UserError(f"{where}: loss_fn_inputs provenance spans cover {total} positions, not {n}")
        recorded = np.zeros(n, dtype=np.float32)
        sampled = np.zeros(n, dtype=np.float32)
        pos = 0
        for span in spans:
            if span.sampled and span.length:
                rec = self.get(span.sequence_id, session_id)
                end = span.offset + span.length
                if end > len(rec.tokens):
                    raise UserError(
                        f"{where}: span [{span.offset}, {end}) is past the {len(rec.tokens)} tokens "
                        f"sampled as {span.sequence_id}"
                    )
                if not np.array_equal(targets[pos : pos + span.length], rec.tokens[span.offset : end]):
                    raise UserError(
                        f"{where}: target_tokens at positions [{pos}, {pos + span.length}) are not the "
                        f"tokens sampled as {span.sequence_id}"
                    )
                recorded[pos : pos + span.length] = rec.logprobs[span.offset : end]
                sampled[pos : pos + span.length] = 1.0
            pos += span.length
        stray = np.nonzero((sampled == 0) & (advantages != 0))[0]
        if len(stray):
            raise UserError(
                f"{where}: stable_reinforce takes advantages only on sampled tokens; position "
                f"{int(stray[0])} is not a sampled token and has advantage {float(advantages[stray[0]])}"
            )
        return recorded, sampled
