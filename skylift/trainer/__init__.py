"""The RL loop: generate -> score -> advantages -> policy update -> weight sync -> eval/checkpoint."""
