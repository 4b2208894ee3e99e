"""The one set of stand-ins for unit tests (issue 29): a clock, a worker
(a WorkerHandle with no process) and an OpenAI-compatible upstream that
answers like llama-server over an httpx.MockTransport. `service.py` puts them
together: a real Service and HTTP app, in-process, with no llama.cpp."""
