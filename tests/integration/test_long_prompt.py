"""An agent's long first prompt is progress, not a hang.

Codex's first request is 4,500 tokens, Claude Code's over 20,000. On the
simulated GPU (llama.cpp on the CPU) 4,000 tokens take tens of seconds to
read, past the first-token deadline, and the GPU worker was killed and
restarted once per client retry. llama-server's prompt_progress events (one
per batch it reads) now move the deadline, and the prompt's speed is
measured from what the worker really read."""

from __future__ import annotations

import uuid

import pytest

from tests.harness import BASE_CONFIG, running

pytestmark = [pytest.mark.integration, pytest.mark.long_running]

# A first-token deadline longer than one batch of the prompt takes to read
# (5-8 s on one thread here), far shorter than the whole prompt (about 50 s).
CONFIG = BASE_CONFIG.replace("n_ctx = 1024", "n_ctx = 5120").replace("first_token_timeout_s = 20",
                                                                     "first_token_timeout_s = 25")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running(tmp_path_factory.mktemp("long-prompt"), CONFIG) as service:
        yield service


def test_a_4000_token_first_prompt_is_answered_on_the_gpu_without_a_restart(service):
    before = service.worker("gpu")
    # Fresh text, so no cached prefix shortens the reading.
    words = " ".join(f"{uuid.uuid4().hex[:6]}" for _ in range(700))
    answer = service.http.post("/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": f"{words}\nSay OK."}], "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] >= 4000
    assert answer.headers["x-served-by"] == "gpu"
    after = service.worker("gpu")
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]
    status = service.status()
    assert not any(e["kind"] == "gpu_failure" for e in status["events"]), status["events"]
