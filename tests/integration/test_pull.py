"""`tray-app pull` against a local hub laid out like Hugging Face: the tree
API and resolve URLs, Range requests, a dropped connection, a server that
ignores Range, a wrong published hash, 404 and 401. It serves the real
bundled SmolLM2 GGUF (a slice of it would not be a valid GGUF). No network."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.fake_hub import PRIVATE_REPO, TOKEN, FakeHub, HubFile, serve_hub
from tray_app.core.config import Config, bundled_model_path
from tray_app.core.catalog.download import (PART_SUFFIX, DownloadCancelled, DownloadError, ErrorKind, download_model,
                                    sha256_of)
from tray_app.core.engine.worker import free_loopback_port
from tray_app.core.catalog.library import build_library

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = "test-org/SmolLM2-GGUF"
# Not the bundled file's own name: the library would refuse two models called the same.
FILE = "quant/smollm2-pulled.Q4_1.gguf"


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return bundled_model_path().read_bytes()


@pytest.fixture
def hub(model_bytes):
    sha = hashlib.sha256(model_bytes).hexdigest()
    state = FakeHub(files={
        (REPO, FILE): HubFile(model_bytes, sha),
        (REPO, "wrong-hash.gguf"): HubFile(model_bytes, "f" * 64),
        (REPO, "no-lfs.gguf"): HubFile(model_bytes, None),
        (PRIVATE_REPO, "m.gguf"): HubFile(model_bytes, sha),
    })
    with serve_hub(state):
        yield state


@pytest.fixture(scope="module")
def expected_sha(model_bytes) -> str:
    return hashlib.sha256(model_bytes).hexdigest()


def test_a_full_download_is_verified_and_renamed(hub, tmp_path, expected_sha, model_bytes):
    seen: list[tuple[int, int | None]] = []
    result = download_model(hub.url, REPO, FILE, tmp_path, progress=lambda d, t: seen.append((d, t)))
    dest = tmp_path / "smollm2-pulled.Q4_1.gguf"
    assert result.path == dest and result.verified and not result.already_present
    assert (result.size, result.sha256, result.resumed_from) == (len(model_bytes), expected_sha, 0)
    assert sha256_of(dest) == expected_sha
    assert not (tmp_path / f"{dest.name}{PART_SUFFIX}").exists()
    assert seen[0] == (0, len(model_bytes)) and seen[-1] == (len(model_bytes), len(model_bytes))
    assert hub.ranges == [None]
    # The tree lookup listed the file's own folder, as the real hub needs.
    assert f"/api/models/{REPO}/tree/main/quant" in hub.requests
    print(f"\nfull download: {result.size / result.elapsed_s / 2**20:.0f} MiB/s over loopback")

    again = download_model(hub.url, REPO, FILE, tmp_path)
    assert again.already_present and again.verified and hub.ranges == [None]


def test_a_dropped_download_resumes_with_a_range_request(hub, tmp_path, expected_sha, model_bytes):
    cut = 40 * 1024 * 1024 + 123
    hub.drop_after = cut
    part = tmp_path / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}"
    with pytest.raises(DownloadError) as caught:
        download_model(hub.url, REPO, FILE, tmp_path, retries=0)
    assert caught.value.kind is ErrorKind.NETWORK and "run again to resume" in str(caught.value)
    assert part.stat().st_size == cut
    assert not (tmp_path / "smollm2-pulled.Q4_1.gguf").exists()

    result = download_model(hub.url, REPO, FILE, tmp_path)
    assert hub.ranges == [None, f"bytes={cut}-"]
    assert (result.sha256, result.resumed_from, result.transferred) == (expected_sha, cut, len(model_bytes) - cut)
    assert not part.exists()


def test_a_drop_is_retried_within_one_call(hub, tmp_path, expected_sha):
    hub.drop_after = 10 * 1024 * 1024
    result = download_model(hub.url, REPO, FILE, tmp_path, retry_delay_s=0.01)
    assert hub.ranges == [None, f"bytes={10 * 1024 * 1024}-"]
    assert result.sha256 == expected_sha and result.resumed_from == 0


def test_a_complete_part_gets_416_and_is_verified(hub, tmp_path, expected_sha, model_bytes):
    (tmp_path / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}").write_bytes(model_bytes)
    result = download_model(hub.url, REPO, FILE, tmp_path)
    assert hub.ranges == [f"bytes={len(model_bytes)}-"]
    assert (result.sha256, result.transferred) == (expected_sha, 0)


def test_a_server_that_ignores_range_starts_over_cleanly(hub, tmp_path, expected_sha):
    hub.ignore_range = True
    part = tmp_path / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}"
    part.write_bytes(b"GGUF" + b"\0" * 5000)  # bytes that would corrupt the file if appended to
    result = download_model(hub.url, REPO, FILE, tmp_path)
    assert hub.ranges == ["bytes=5004-"]
    assert result.sha256 == expected_sha and result.restarts == 1
    assert sha256_of(result.path) == expected_sha


def test_a_wrong_published_hash_is_refused_and_leaves_nothing(hub, tmp_path, expected_sha):
    with pytest.raises(DownloadError) as caught:
        download_model(hub.url, REPO, "wrong-hash.gguf", tmp_path)
    assert caught.value.kind is ErrorKind.HASH_MISMATCH
    assert expected_sha in str(caught.value) and "f" * 64 in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_no_published_hash_needs_no_verify(hub, tmp_path, expected_sha):
    with pytest.raises(DownloadError, match="--no-verify") as caught:
        download_model(hub.url, REPO, "no-lfs.gguf", tmp_path)
    assert caught.value.kind is ErrorKind.NO_HASH and hub.ranges == []
    result = download_model(hub.url, REPO, "no-lfs.gguf", tmp_path, verify=False)
    assert not result.verified and result.sha256 == expected_sha


def test_not_found_and_auth_errors(hub, tmp_path):
    with pytest.raises(DownloadError, match="has no test-org/nope at revision main") as caught:
        download_model(hub.url, "test-org/nope", "m.gguf", tmp_path)
    assert caught.value.kind is ErrorKind.NOT_FOUND
    with pytest.raises(DownloadError, match="has no file absent.gguf at revision main") as caught:
        download_model(hub.url, REPO, "absent.gguf", tmp_path)
    assert caught.value.kind is ErrorKind.NOT_FOUND
    with pytest.raises(DownloadError, match="set HF_TOKEN") as caught:
        download_model(hub.url, PRIVATE_REPO, "m.gguf", tmp_path)
    assert caught.value.kind is ErrorKind.AUTH
    with pytest.raises(DownloadError, match="token in HF_TOKEN has no access") as caught:
        download_model(hub.url, PRIVATE_REPO, "m.gguf", tmp_path, token="hf_wrong")
    assert caught.value.kind is ErrorKind.AUTH
    assert download_model(hub.url, PRIVATE_REPO, "m.gguf", tmp_path, token=TOKEN).verified
    assert list(tmp_path.iterdir()) == [tmp_path / "m.gguf"]


def test_a_network_error_is_one_line(tmp_path):
    with pytest.raises(DownloadError) as caught:
        download_model(f"http://127.0.0.1:{free_loopback_port()}", REPO, FILE, tmp_path)
    assert caught.value.kind is ErrorKind.NETWORK and "\n" not in str(caught.value)


def test_cancel_keeps_the_part_for_a_resume(hub, tmp_path, expected_sha):
    cancel = threading.Event()

    def progress(done: int, total: int | None) -> None:
        if done >= 20 * 1024 * 1024:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        download_model(hub.url, REPO, FILE, tmp_path, progress=progress, cancel=cancel)
    part = tmp_path / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}"
    kept = part.stat().st_size
    assert kept >= 20 * 1024 * 1024
    result = download_model(hub.url, REPO, FILE, tmp_path, client=httpx.Client())
    assert hub.ranges[-1] == f"bytes={kept}-" and result.sha256 == expected_sha


def test_an_existing_different_file_is_not_overwritten(hub, tmp_path):
    (tmp_path / "smollm2-pulled.Q4_1.gguf").write_bytes(b"GGUF something else")
    with pytest.raises(DownloadError, match="already exists with other content") as caught:
        download_model(hub.url, REPO, FILE, tmp_path)
    assert caught.value.kind is ErrorKind.EXISTS and hub.ranges == []


# ----- the command, as a user runs it -------------------------------------------------


def run_pull(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"),
           "XDG_STATE_HOME": str(home / "state"), "XDG_CACHE_HOME": str(home / "cache")}
    env.pop("HF_TOKEN", None)
    env.pop("TRAY_APP_HUB_URL", None)
    # A port nobody listens on: a developer's own running service must not change the fit line.
    url = f"http://127.0.0.1:{free_loopback_port()}"
    return subprocess.run([sys.executable, "-m", "tray_app", "pull", *args, "--url", url],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_the_command_pulls_into_the_models_folder_and_the_library_finds_it(hub, tmp_path, monkeypatch,
                                                                          expected_sha):
    done = run_pull(tmp_path, f"{REPO}/{FILE}", "--hub", hub.url, "--simulate-gpu-mib", "8192")
    assert done.returncode == 0, done.stderr
    models = tmp_path / "data" / "tray-app" / "models"
    assert sha256_of(models / "smollm2-pulled.Q4_1.gguf") == expected_sha
    assert "Fit (rough, from the file size" in done.stdout and "fits on the GPU" in done.stdout
    assert "sha256 verified" in done.stdout and "'smollm2-pulled.Q4_1'" in done.stdout
    assert expected_sha in done.stderr  # the published hash, said before downloading

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    library = build_library(Config())
    pulled = library.resolve("smollm2-pulled.Q4_1")
    assert pulled is not None and pulled.source == "folder"
    assert pulled.path == models / "smollm2-pulled.Q4_1.gguf"

    again = run_pull(tmp_path, f"{REPO}:{FILE}", "--hub", hub.url)
    assert again.returncode == 0 and "already there (same sha256)" in again.stdout


def test_the_command_reads_the_hub_from_the_environment_and_checks_only(hub, tmp_path):
    env_home = tmp_path
    done = subprocess.run(
        [sys.executable, "-m", "tray_app", "pull", f"{REPO}/{FILE}", "--check-only", "--simulate-gpu-mib", "512",
         "--url", f"http://127.0.0.1:{free_loopback_port()}"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "TRAY_APP_HUB_URL": hub.url, "XDG_DATA_HOME": str(env_home / "data"),
             "XDG_CONFIG_HOME": str(env_home / "config")})
    assert done.returncode == 0, done.stderr
    # 94 MiB + 512 MiB of runtime is more than 512 MiB of simulated VRAM minus the reserve.
    assert "fits only on the CPU" in done.stdout
    assert hub.ranges == [] and not (env_home / "data" / "tray-app" / "models").exists()


@pytest.mark.parametrize("args, code, words", [
    ([f"{REPO}/README.md"], 2, "not a .gguf file"),
    (["just-a-name.gguf"], 2, "names no file"),
    (["test-org/nope/m.gguf"], 1, "has no test-org/nope"),
    ([f"{PRIVATE_REPO}/m.gguf"], 1, "HF_TOKEN"),
    ([f"{REPO}/wrong-hash.gguf"], 1, "is corrupt"),
])
def test_the_command_fails_with_one_line(hub, tmp_path, args, code, words):
    done = run_pull(tmp_path, *args, "--hub", hub.url, "--simulate-gpu-mib", "8192")
    assert done.returncode == code
    errors = [line for line in done.stderr.splitlines() if line.startswith("tray-app: error:")]
    assert len(errors) == 1 and words in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "data" / "tray-app" / "models").glob("*.gguf"))


def test_an_unwritable_models_folder_is_one_line(hub, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the models folder should be")
    with pytest.raises(DownloadError, match="cannot write the model into") as caught:
        download_model(hub.url, REPO, FILE, blocker / "models")
    assert caught.value.kind is ErrorKind.LOCAL


def test_too_little_disk_space_is_refused_before_any_byte(hub, tmp_path, monkeypatch):
    import shutil

    from tray_app.core.catalog import download

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: real._replace(free=10 * 1024 * 1024))
    with pytest.raises(DownloadError, match="not enough space") as caught:
        download_model(hub.url, REPO, FILE, tmp_path)
    assert caught.value.kind is ErrorKind.DISK_FULL and hub.ranges == []


# ----- a hostile hub, or a hostile neighbour in the models folder ---------------------


def test_a_symlink_planted_as_the_part_is_never_written_through(hub, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    models = tmp_path / "models"
    models.mkdir()
    (models / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}").symlink_to(victim)
    with pytest.raises(DownloadError, match="not a plain file of its own") as caught:
        download_model(hub.url, REPO, FILE, models)
    assert caught.value.kind is ErrorKind.LOCAL
    assert victim.read_bytes() == b"precious" and hub.ranges == []


def test_a_hard_link_planted_as_the_part_is_never_written_through(hub, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"GGUF" + b"\0" * 100)  # looks like the start of a resumable part
    models = tmp_path / "models"
    models.mkdir()
    os.link(victim, models / f"smollm2-pulled.Q4_1.gguf{PART_SUFFIX}")
    with pytest.raises(DownloadError, match="not a plain file of its own"):
        download_model(hub.url, REPO, FILE, models)
    assert victim.read_bytes() == b"GGUF" + b"\0" * 100 and hub.ranges == []


def test_a_download_of_unannounced_size_is_not_started(hub, tmp_path):
    # No size in the file list, and the body chunked: nothing bounds what the hub may send.
    hub.list_sizes, hub.chunked = False, True
    with pytest.raises(DownloadError, match="did not say how large") as caught:
        download_model(hub.url, REPO, FILE, tmp_path)
    assert caught.value.kind is ErrorKind.SERVER
    assert not list(tmp_path.glob("*.gguf")) and all(p.stat().st_size == 0 for p in tmp_path.iterdir())


def test_a_size_announced_only_by_the_answer_is_checked_against_free_space(hub, tmp_path, monkeypatch):
    import shutil

    from tray_app.core.catalog import download

    hub.list_sizes = False  # the file list says no size; the answer's Content-Length does
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: real._replace(free=10 * 1024 * 1024))
    with pytest.raises(DownloadError, match="not enough space") as caught:
        download_model(hub.url, REPO, FILE, tmp_path)
    assert caught.value.kind is ErrorKind.DISK_FULL
    assert all(p.stat().st_size == 0 for p in tmp_path.iterdir())


def test_the_token_never_follows_a_file_list_to_another_host(hub, tmp_path):
    with serve_hub(FakeHub(files={})) as elsewhere:
        hub.next_page = f"{elsewhere.url}/api/models/{PRIVATE_REPO}/tree/main?cursor=2"
        with pytest.raises(DownloadError, match="continues on another host") as caught:
            download_model(hub.url, PRIVATE_REPO, "m.gguf", tmp_path, token=TOKEN)
        assert caught.value.kind is ErrorKind.SERVER
        assert elsewhere.requests == [] and elsewhere.authorizations == []
    assert hub.authorizations == [f"Bearer {TOKEN}"] and hub.ranges == []


def test_the_command_prints_no_escape_sequence_from_the_hub(hub, tmp_path):
    hub.extra_entries = [{"type": "\x1b]0;owned\x07\x1b[2J", "path": "evil.gguf"}]
    done = run_pull(tmp_path, f"{REPO}/evil.gguf", "--hub", hub.url, "--simulate-gpu-mib", "8192")
    assert done.returncode == 1
    assert "\x1b" not in done.stderr + done.stdout and "\x07" not in done.stderr
    assert "\\x1b]0;owned\\x07" in done.stderr
