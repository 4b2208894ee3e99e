"""What fits where: GPU/host telemetry, GGUF metadata, the memory estimator, fit advice."""
