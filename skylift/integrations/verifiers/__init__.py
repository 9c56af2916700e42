"""verifiers 0.4 env servers (v1 API) playing rows on the run's own engines (`rollouts`)."""
