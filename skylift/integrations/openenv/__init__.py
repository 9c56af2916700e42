"""OpenEnv servers as the ``openenv`` environment (`env`)."""
