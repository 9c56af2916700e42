"""The RL step: take rollouts -> experience -> update -> sync -> evaluate -> checkpoint."""
