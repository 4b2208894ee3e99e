"""Structured output checked outside the service: check.py owns a child process, child.py runs in it
(converts a JSON schema and has llama.cpp parse the grammar), so a crash there is one request's 400."""
