"""A finished answer teaches its path the time to its first token, which the
latency estimate reads prompts by (latency.FirstTokenFit): the real Service
in-process, its GPU worker answering through the fake llama-server."""

from __future__ import annotations

from tests.fakes.service import in_process_service, isolate_user_folders


async def test_a_finished_answer_teaches_its_path_the_time_to_its_first_token(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        gpu = rig.service.dispatcher.gpu
        assert gpu.busy_speeds.first_token.fit(1000.0) is None
        # Each token comes a little later, so the first one is never at the start.
        rig.upstream.script("gpu").token_delay_s = 0.01
        answer = await rig.client.post("/v1/chat/completions", json={
            "model": rig.service.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "gpu"
        line = gpu.busy_speeds.first_token.fit(1000.0)
        assert line is not None and line.seconds(100) > 0
        # The estimate reads prompts by that line, not by the prompt speed.
        assert gpu.busy_speeds.curve(100.0, 1000.0).first_token == line

