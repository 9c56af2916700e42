"""tinker-cookbook's token-level ``Env`` / ``EnvGroupBuilder`` as skylift environments (`env`)."""
