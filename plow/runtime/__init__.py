"""plowrt: executors that run a model step (reference numpy forward; CPU emulation; CUDA)."""
