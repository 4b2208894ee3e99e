"""Images on every API, on real workers with a real projector.

The default model is the bundled SmolLM2 with the tiny random-weight LLaVA
projector (tests/tiny_projector.py) beside it, so both workers load it with
--mmproj; a second library model ("plain") has none. The answers are noise:
what is checked is that llama-server ran the image (its prompt counts the
image's 16 tokens), on the path the headers name, and that every bad image is
a 400 naming its part."""

from __future__ import annotations

import base64
import contextlib
import os

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.harness import BASE_CONFIG, running
from tests.tiny_projector import image_tokens, tiny_png, write_tiny_projector
from tray_app.core.config import bundled_model_path
from tray_app.core.memory.gguf_info import read_model_info

pytestmark = pytest.mark.integration

PNG = tiny_png()
PNG_B64 = base64.b64encode(PNG).decode()
DATA_URI = f"data:image/png;base64,{PNG_B64}"
IMAGE_TOKENS = image_tokens()
MODEL = bundled_model_path().stem
# A long prompt keeps the GPU busy before its first token, so the kill lands
# there (the GPU's context is 1024 tokens: this, the image and the answer fit).
SLOW_TEXT = "word " * 700 + "\nDescribe the picture."


def model_folder(folder, *, projector: bool):
    """A folder with the bundled model linked in, and the tiny projector beside it if asked."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / bundled_model_path().name
    os.symlink(bundled_model_path(), link)
    if projector:
        write_tiny_projector(folder / "mmproj-tiny.gguf", text_width=read_model_info(bundled_model_path()).n_embd)
    return link


def image_config(tmp, *, cpu_sees: bool) -> str:
    seeing = model_folder(tmp / "seeing", projector=True)
    plain = model_folder(tmp / "plain", projector=False)
    # The CPU fallback is the same file in a folder without a projector when the CPU must not see.
    fallback = "" if cpu_sees else f'fallback_path = "{model_folder(tmp / "blind", projector=False)}"\n'
    return (BASE_CONFIG + f'[model]\npath = "{seeing}"\nfolder = "{tmp / "empty"}"\n{fallback}'
            f'[[models]]\nname = "plain"\npath = "{plain}"\n')


@contextlib.contextmanager
def image_service(tmp_path_factory, name: str, *, cpu_sees: bool):
    """A running service whose default model has the tiny projector (on both workers when cpu_sees)."""
    tmp = tmp_path_factory.mktemp(name)
    with running(tmp, image_config(tmp, cpu_sees=cpu_sees)) as service:
        yield service


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    with image_service(tmp_path_factory, "images", cpu_sees=True) as service:
        yield service


@pytest.fixture
def fresh(seeing):
    seeing.reset()
    return seeing


def openai_client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)


def ask(text: str, *images: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": url}} for url in images)]}]


def text_prompt_tokens(service, text: str) -> int:
    """What the same question costs without its image, on the GPU worker."""
    reply = openai_client(service).chat.completions.create(model=MODEL, messages=ask(text), max_tokens=1)
    return reply.usage.prompt_tokens


@pytest.mark.parametrize("path", ["gpu", "cpu"])
def test_openai_image_url_runs_on_either_path_and_counts_the_images_tokens(fresh, path):
    raw = openai_client(fresh).chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("What is in the picture?", DATA_URI), max_tokens=4,
        extra_headers={"X-Force-Path": "cpu"} if path == "cpu" else {})
    reply = raw.parse()
    assert raw.headers["x-served-by"] == path
    assert reply.choices[0].finish_reason in ("length", "stop")
    # llama-server counted the image's tokens: the worker ran the projector.
    assert reply.usage.prompt_tokens == text_prompt_tokens(fresh, "What is in the picture?") + IMAGE_TOKENS


def test_ollama_images_on_chat_and_generate(fresh):
    client = ollama.Client(host=fresh.url)
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe it.", "images": [PNG]}],
                       options={"num_predict": 3})
    with_image = chat.prompt_eval_count
    plain = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe it."}],
                        options={"num_predict": 3}).prompt_eval_count
    assert with_image == plain + IMAGE_TOKENS
    generated = client.generate(model=MODEL, prompt="Describe it.", images=[PNG_B64], options={"num_predict": 3})
    assert generated.prompt_eval_count == with_image


def test_anthropic_base64_image_block(fresh):
    client = anthropic.Anthropic(base_url=fresh.url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    with_image = client.messages.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}])
    plain = client.messages.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Describe it."}]}])
    assert with_image.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS


def test_responses_input_image(fresh):
    client = openai_client(fresh)
    content = [{"type": "input_text", "text": "Describe it."}]
    plain = client.responses.create(model=MODEL, max_output_tokens=16, input=[{"role": "user", "content": content}])
    with_image = client.responses.create(model=MODEL, max_output_tokens=16, input=[
        {"role": "user", "content": [*content, {"type": "input_image", "image_url": DATA_URI, "detail": "auto"}]}])
    assert with_image.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS


@pytest.mark.parametrize(("url", "code", "words"), [
    ("data:image/png;base64,@@not base64@@", "invalid_image", "not valid base64"),
    (f"data:image/png;base64,{base64.b64encode(b'just some text, no image').decode()}", "invalid_image",
     "not an image"),
    ("https://example.com/cat.png", "remote_image_refused", "does not fetch images from URLs"),
])
def test_a_bad_image_is_a_400_that_names_the_part(seeing, url, code, words):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(seeing).chat.completions.create(model=MODEL, messages=ask("Look", DATA_URI, url), max_tokens=1)
    error = refused.value.body
    assert error["code"] == code
    assert error["param"] == "messages[0].content[2]"
    assert words in error["message"]


def test_ollama_and_anthropic_bad_images_name_their_part(seeing):
    answer = httpx.post(f"{seeing.url}/api/chat", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi", "images": [PNG_B64, "bm90IGFuIGltYWdl"]}]}, timeout=30)
    assert answer.status_code == 400 and "messages[0].images[1]" in answer.json()["error"]
    answer = httpx.post(f"{seeing.url}/v1/messages", headers={"x-api-key": "unused"}, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}]}]}, timeout=30)
    assert answer.status_code == 400
    assert "messages.0.content.0.source.data" in answer.json()["error"]["message"]


def test_a_model_without_a_projector_refuses_and_names_one_that_sees(seeing):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(seeing).chat.completions.create(model="plain", messages=ask("Look", DATA_URI), max_tokens=1)
    assert refused.value.body["code"] == "model_has_no_vision"
    assert MODEL in refused.value.body["message"]


def test_a_gpu_kill_before_the_first_byte_replays_the_image_on_the_cpu(fresh):
    expected = text_prompt_tokens(fresh, SLOW_TEXT) + IMAGE_TOKENS

    def run():
        raw = openai_client(fresh).chat.completions.with_raw_response.create(
            model=MODEL, messages=ask(SLOW_TEXT, DATA_URI), max_tokens=4,
            extra_headers={"X-Request-Id": "image-kill"})
        return raw.headers, raw.parse()

    headers, reply = fresh.kill_gpu_before_first_token("image-kill", run)
    assert headers["x-served-by"] == "cpu"
    assert headers["x-route-reason"] == "gpu_failed_replayed"
    # The replay carried the image: the CPU worker counted its tokens too.
    assert reply.usage.prompt_tokens == expected


def test_each_api_says_which_models_see(seeing):
    models = {m["id"]: m["capabilities"] for m in seeing.http.get("/v1/models").json()["data"]}
    assert (models[MODEL]["vision"], models[MODEL]["input_modalities"]) == (True, ["text", "image"])
    assert (models["plain"]["vision"], models["plain"]["input_modalities"]) == (False, ["text"])
    tags = {m["name"]: m["capabilities"] for m in seeing.http.get("/api/tags").json()["models"]}
    # The default model also runs /api/embed.
    assert tags[f"{MODEL}:latest"] == ["completion", "tools", "vision", "embedding"]
    assert tags["plain:latest"] == ["completion", "tools"]
    assert "vision" in ollama.Client(host=seeing.url).show(MODEL).capabilities
    assert "vision" not in seeing.http.post("/api/show", json={"model": "plain"}).json()["capabilities"]
    assert seeing.http.get("/props").json()["modalities"]["vision"] is True
    assert seeing.http.get("/props", params={"model": "plain"}).json()["modalities"]["vision"] is False


@pytest.fixture(scope="module")
def blind_cpu(tmp_path_factory):
    """The projector beside the GPU's model only: the CPU fallback is the same
    weights from a folder without one, so its worker can't read images."""
    with image_service(tmp_path_factory, "blind", cpu_sees=False) as service:
        yield service


def test_a_cpu_that_cant_see_refuses_an_image_rather_than_answer_without_it(blind_cpu):
    client = openai_client(blind_cpu)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=ask("Look", DATA_URI), max_tokens=1,
                                       extra_headers={"X-Force-Path": "cpu"})
    assert (refused.value.status_code, refused.value.code) == (503, "cpu_cannot_read_images")
    assert "can't read" in refused.value.message and refused.value.response.headers.get("retry-after")
    assert refused.value.response.headers["x-route-reason"] == "cpu_cannot_read_images"
    # Text still goes to that CPU worker.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Look"), max_tokens=1, extra_headers={"X-Force-Path": "cpu"})
    assert raw.headers["x-served-by"] == "cpu"


def test_a_gpu_kill_with_a_blind_cpu_is_a_clear_error_not_a_text_only_answer(blind_cpu):
    blind_cpu.reset()

    def run():
        response = httpx.post(f"{blind_cpu.url}/v1/chat/completions", timeout=120, headers={
            "X-Request-Id": "blind-kill"}, json={"model": MODEL, "messages": ask(SLOW_TEXT, DATA_URI),
                                                 "max_tokens": 4})
        # The harness skips when the GPU answered; a refusal names the GPU as its path too.
        answered_by = response.headers.get("x-served-by") if response.status_code == 200 else "none"
        return {"x-served-by": answered_by}, response

    headers, response = blind_cpu.kill_gpu_before_first_token("blind-kill", run)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "cpu_cannot_read_images"
    assert "can't read" in response.json()["error"]["message"]


def test_pull_fetches_the_projector_beside_the_model_and_the_library_pairs_them(tmp_path, monkeypatch):
    import hashlib

    from tests.fake_hub import FakeHub, HubFile, serve_hub
    from tests.integration.test_pull import run_pull
    from tray_app.core.config import Config
    from tray_app.core.catalog.library import build_library

    model = bundled_model_path().read_bytes()
    write_tiny_projector(tmp_path / "p.gguf", text_width=576)
    projector = (tmp_path / "p.gguf").read_bytes()
    files = {("org/Vision-GGUF", "vision-pulled.gguf"): HubFile(model, hashlib.sha256(model).hexdigest()),
             ("org/Vision-GGUF", "mmproj-vision-f16.gguf"): HubFile(projector, hashlib.sha256(projector).hexdigest()),
             ("org/Vision-GGUF", "mmproj-vision-q8_0.gguf"): HubFile(b"GGUF", hashlib.sha256(b"GGUF").hexdigest())}
    with serve_hub(FakeHub(files=files)) as hub:
        done = run_pull(tmp_path, "org/Vision-GGUF/vision-pulled.gguf", "--hub", hub.url, "--simulate-gpu-mib",
                        "8192")
    assert done.returncode == 0, done.stderr
    assert "vision projector" in done.stdout
    folder = tmp_path / "data" / "tray-app" / "models" / "vision-pulled"
    assert (folder / "mmproj-vision-f16.gguf").read_bytes() == projector
    assert not (folder / "mmproj-vision-q8_0.gguf").exists()
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    pulled = build_library(Config()).resolve("vision-pulled")
    assert (pulled.path, pulled.mmproj) == (folder / "vision-pulled.gguf", folder / "mmproj-vision-f16.gguf")
