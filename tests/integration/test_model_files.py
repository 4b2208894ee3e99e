"""Model files on the disk while the service runs: a rescan reads the folder
in a thread (never on the event loop) and adds each new file once; a model
file deleted under the running service does not break the model list."""

from __future__ import annotations

import asyncio
import io
import shutil
import threading

import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core import model_host as host_module
from tray_app.core import service as service_module
from tray_app.core.config import bundled_model_path, parse_config_text
from tray_app.core.service import Service

pytestmark = pytest.mark.integration


def folder_config(folder) -> str:
    return BASE_CONFIG + f'[model]\nfolder = "{folder}"\n'


async def test_a_rescan_reads_the_folder_in_a_thread_and_adds_each_file_once(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    folder.mkdir()
    service = Service(parse_config_text(folder_config(folder)), log_dir=tmp_path / "logs")
    loop_thread = threading.get_ident()
    disk_threads: set[int] = set()

    def recorded(function):
        def call(*args, **kwargs):
            disk_threads.add(threading.get_ident())
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(service_module, "build_library", recorded(service_module.build_library))
    monkeypatch.setattr(host_module, "read_model_info", recorded(host_module.read_model_info))
    try:
        shutil.copyfile(bundled_model_path(), folder / "fresh.gguf")
        (folder / "broken.gguf").write_bytes(b"GGUF cut short")
        # Two rescans at once, as two `tray-app pull`s finishing together would ask.
        first, second = await within(60, asyncio.gather(service.rescan_models(), service.rescan_models()))
        assert first["added"] + second["added"] == ["fresh"]
        assert disk_threads and loop_thread not in disk_threads
        assert [m.name for m in service.library].count("fresh") == 1 and "fresh" in service.model_hosts
        # The answer says which file and why in a sentence; the path and the parser's detail go to the log.
        skipped = first["skipped"] + second["skipped"]
        assert skipped and all(line.startswith("broken.gguf: not a readable GGUF") for line in skipped)
        assert not any(str(folder) in line for line in skipped)
    finally:
        await within(30, service.http.aclose())


async def within(seconds: float, awaitable):
    """`awaitable` under a deadline. Once in a clean-clone run this test
    sat on an idle event loop (no thread left to wake it) until pytest's own
    timeout: should it happen again, the failure names every pending task
    and where it waits, which pytest's thread dump can't show."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        return task.result()
    stacks = io.StringIO()  # before the cancel, while each task still waits where it hung
    for pending in asyncio.all_tasks():
        pending.print_stack(file=stacks)
    threads = sorted(thread.name for thread in threading.enumerate())
    task.cancel()
    pytest.fail(f"no answer in {seconds} s; threads {threads}; pending tasks:\n{stacks.getvalue()}")


def test_a_model_file_deleted_while_serving_leaves_the_model_list_working(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    doomed = folder / "doomed.gguf"
    shutil.copyfile(bundled_model_path(), doomed)
    with running(tmp_path / "svc", folder_config(folder)) as service:
        before = service.http.get("/api/tags")
        assert before.status_code == 200
        listed = {m["name"]: m for m in before.json()["models"]}
        assert "doomed:latest" in listed
        doomed.unlink()
        after = service.http.get("/api/tags")
        assert after.status_code == 200, after.text
        # The list describes each model as it was loaded; the others are all still there.
        assert after.json()["models"] == before.json()["models"]
        assert service.http.get("/v1/models").status_code == 200
        shown = service.http.post("/api/show", json={"model": "doomed"})
        assert shown.status_code == 200, shown.text
        assert shown.json()["modified_at"] == listed["doomed:latest"]["modified_at"]
