"""Embeddings: a worker of their own with its own lane, loaded on demand (path.py), and its wiring
from the config and the default model (setup.py)."""
