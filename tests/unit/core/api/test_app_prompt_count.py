"""Where the HTTP app counts a prompt: a short one on the event loop (a
worker thread's hand-off cost more than the count and, with several
requests arriving together, staggered their arrival at the worker: issue
32), a long one in a thread, so the loop never tokenizes for long. The real
Service and app in-process (tests/fakes/)."""

from __future__ import annotations

import asyncio

from tests.fakes.service import in_process_service, isolate_user_folders
from tray_app.core.catalog.tokens import QUICK_COUNT_BYTES


async def test_a_short_prompt_is_counted_on_the_loop_and_a_long_one_in_a_thread(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    in_threads: list[str] = []
    real_to_thread = asyncio.to_thread

    async def recording_to_thread(function, *args, **kwargs):
        in_threads.append(getattr(function, "__name__", repr(function)))
        return await real_to_thread(function, *args, **kwargs)

    async with in_process_service(tmp_path) as rig:
        counter = rig.service.default_model_host.counter
        monkeypatch.setattr(asyncio, "to_thread", recording_to_thread)
        cases = {
            "short chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                           counter.count_chat([{"role": "user", "content": "Hi"}])),
            "short completion": ("/v1/completions", {"prompt": "Once upon"}, counter.count_text("Once upon")),
        }
        long_text = "word " * QUICK_COUNT_BYTES
        cases["long chat"] = ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
                              counter.count_chat([{"role": "user", "content": long_text}]))
        cases["long completion"] = ("/v1/completions", {"prompt": long_text}, counter.count_text(long_text))
        counted_in_threads = {}
        for name, (path, body, tokens) in cases.items():
            in_threads.clear()
            answer = await rig.client.post(path, json={**body, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] == tokens, name
            counted_in_threads[name] = [f for f in in_threads if f in ("count", "chat_prompt", "count_chat",
                                                                          "count_text")]
    assert counted_in_threads == {"short chat": [], "short completion": [],
                                  "long chat": ["chat_prompt", "count"], "long completion": ["count"]}
