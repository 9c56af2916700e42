"""Schema revisions, oldest first (0001 is the schema from before migrations existed)."""
