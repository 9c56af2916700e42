"""The Tinker service's database: table models (`models`), versioned schema (`migrate`, Alembic
scripts under `migrations/`). `skylift.tinker.storage.store.Store` is the typed access on top."""
