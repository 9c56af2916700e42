"""Ownership checks: a user sees and touches only its own records (and published checkpoints).

Another user's id or `tinker://` path is answered exactly like one that does not exist (the
same `NotFoundError` text the service uses for unknown ids), so a caller cannot tell that it
exists. A session's owner owns its models and samplers; a checkpoint belongs to the owner of
its training run. Every method is blocking (one indexed query); the app calls them in a thread.
"""

from __future__ import annotations

from skylift.tinker.errors import NotFoundError, UserError, unknown
from skylift.tinker.errors import missing_checkpoint as _missing
from skylift.tinker.storage.store import SamplingSessionRow, Store
from skylift.tinker.storage.views import is_public, parse_tinker_path


def unknown_session(session_id: object) -> NotFoundError:
    return unknown("session", session_id)


def unknown_model(model_id: object) -> NotFoundError:
    return unknown("model id", model_id)


def unknown_run(run_id: object) -> NotFoundError:
    return unknown("training run", run_id)


def unknown_sampler(sampler_id: object) -> NotFoundError:
    return unknown("sampler", sampler_id)


def unknown_sampling_session(sampler_id: object) -> NotFoundError:
    return unknown("sampling session", sampler_id)


def missing_checkpoint(path: object, sampler: bool = False) -> NotFoundError:
    return _missing(path, "sampler checkpoint" if sampler else "checkpoint")


class Owners:
    """`user` may be None only on internal calls (no check)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def owns_session(self, user: str, session_id: object) -> bool:
        return isinstance(session_id, str) and self.store.session_owner(session_id) == user

    def owns_model(self, user: str, model_id: object) -> bool:
        return isinstance(model_id, str) and self.store.model_owner(model_id) == user

    def owns_sampler(self, user: str, sampler_id: object) -> bool:
        return isinstance(sampler_id, str) and self.store.sampler_owner(sampler_id) == user

    def may_read_path(self, user: str, path: object) -> bool:
        """True when `path` is malformed (the service explains why), the user's own checkpoint
        path or a published checkpoint."""
        try:
            run_id, _, _ = parse_tinker_path(path)  # type: ignore[arg-type]
        except UserError:
            return True
        if self.store.model_owner(run_id) == user:
            return True
        row = self.store.checkpoint(str(path))
        return row is not None and is_public(row)

    def may_use_sampler(self, user: str, sampler_id: object) -> bool:
        """The user's own sampler, and still allowed to read the checkpoint it samples from (one
        of another user's that was unpublished since is no longer readable)."""
        if not self.owns_sampler(user, sampler_id):
            return False
        row = self.store.get(SamplingSessionRow, str(sampler_id))
        return row is None or not row.model_path or self.may_read_path(user, row.model_path)

    def may_write_path(self, user: str, path: object) -> bool:
        """Deleting or publishing: only the owner (a malformed path: the service explains)."""
        try:
            run_id, _, _ = parse_tinker_path(path)  # type: ignore[arg-type]
        except UserError:
            return True
        return self.store.model_owner(run_id) == user

    # ---------------------------------------------------------------- raising variants
    def session(self, user: str, session_id: object) -> None:
        if not self.owns_session(user, session_id):
            raise unknown_session(session_id)

    def model(self, user: str, model_id: object) -> None:
        if not self.owns_model(user, model_id):
            raise unknown_model(model_id)

    def run(self, user: str, run_id: object) -> None:
        if not self.owns_model(user, run_id):
            raise unknown_run(run_id)

    def sampler(self, user: str, sampler_id: object) -> None:
        if not self.owns_sampler(user, sampler_id):
            raise unknown_sampler(sampler_id)
