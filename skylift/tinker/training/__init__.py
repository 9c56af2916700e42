"""Training clients: admission, the per-model training state over the shared base weights, the
Tinker losses, and the training operations (forward/backward, optimizer steps, saving and loading
weights) with their router and bodies."""
