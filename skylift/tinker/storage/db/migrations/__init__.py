"""Alembic environment of the Tinker service's schema (run through `skylift.tinker.storage.db.migrate`)."""
