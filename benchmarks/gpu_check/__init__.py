"""Proving the app on a real NVIDIA GPU machine."""
