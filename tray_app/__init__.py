"""Home AI server tray app: GPU and CPU llama.cpp workers behind one OpenAI-compatible port."""

__version__ = "0.1.0"
