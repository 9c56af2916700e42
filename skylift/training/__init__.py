"""Training: the policy/reference/critic workers and the tensors they consume."""
