"""Images, the pure parts: checking an image part, pairing a projector with a
model, what the projector costs in memory, the worker's flags, and admission
keeping images off a CPU that can't read them."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_projector import image_tokens, png_bomb, tiny_png, write_tiny_projector
from tray_app.core.api import anthropic, ollama, openai_request
from tray_app.core.api.openai_request import (
    InvalidRequest, Vision, flatten_content, image_pixels, text_only,
)
from tray_app.core.dispatch.admission import (
    CpuView, GpuOut, GpuView, LaneState, Reason, RequestShape, Route, decide,
)
from tray_app.core.engine.runtime import IMAGE_MAX_TOKENS, LaunchRequest, LlamaServerRuntime
from tray_app.core.catalog.library import build_library, gguf_files, projector_beside
from tray_app.core.memory import estimate
from tray_app.core.config import bundled_model_path
from tray_app.core.memory.gguf_info import ModelFileError, read_model_info, read_paired_projector, read_projector_info

PNG = tiny_png()
DATA_URI = "data:image/png;base64," + base64.b64encode(PNG).decode()
SEES = Vision("m", sees=True)


def image_message(url: str = DATA_URI) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


# ----- the request ---------------------------------------------------------------------------


def test_an_image_part_stays_a_part_and_its_text_is_counted_apart():
    messages = image_message()
    assert flatten_content(messages, SEES).count == 1
    assert messages[0]["content"] == [{"type": "text", "text": "look"},
                                      {"type": "image_url", "image_url": {"url": DATA_URI}}]
    assert text_only(messages) == [{"role": "user", "content": "look"}]


def test_a_message_without_images_is_still_one_string():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert flatten_content(messages, SEES).count == 0
    assert messages[0]["content"] == "a\nb"


@pytest.mark.parametrize(("raw", "code"), [
    (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "unsupported_image_format"),
    (b"%PDF-1.7", "invalid_image"),
])
def test_what_llama_cpp_cant_decode_is_refused(raw, code):
    with pytest.raises(InvalidRequest) as refused:
        flatten_content(image_message("data:image/png;base64," + base64.b64encode(raw).decode()), SEES)
    assert (refused.value.code, refused.value.param) == (code, "messages[0].content[1]")


@pytest.mark.parametrize(("raw", "words"), [
    (PNG[:50], "cut off"),
    (PNG[:-1] + b"\x00", "fails its checksum"),
    (PNG[:-12], "ends before its last chunk"),
    (b"\xff\xd8\xff\xe0" + bytes(20), "end-of-image marker"),
    (b"GIF89a" + bytes(20), "trailer"),
    (b"BM" + (5000).to_bytes(4, "little") + bytes(40), "says 5000 bytes"),
])
def test_a_cut_off_or_corrupt_image_is_refused_here_naming_the_part(raw, words):
    with pytest.raises(InvalidRequest) as refused:
        flatten_content(image_message("data:image/png;base64," + base64.b64encode(raw).decode()), SEES)
    assert refused.value.code == "invalid_image" and refused.value.param == "messages[0].content[1]"
    assert words in refused.value.message


def test_an_image_over_the_bound_is_refused_before_it_is_decoded(monkeypatch):
    monkeypatch.setattr(openai_request, "MAX_IMAGE_BYTES", 30)
    with pytest.raises(InvalidRequest) as refused:
        flatten_content(image_message("data:image/png;base64," + base64.b64encode(PNG + bytes(40)).decode()), SEES)
    assert refused.value.code == "image_too_large"


def test_a_model_without_vision_names_the_ones_that_see():
    with pytest.raises(InvalidRequest) as refused:
        flatten_content(image_message(), Vision("plain", sees=False, seeing_models=("llava", "plain")))
    assert refused.value.code == "model_has_no_vision"
    assert "llava" in refused.value.message and "mmproj" not in refused.value.message
    with pytest.raises(InvalidRequest) as alone:
        flatten_content(image_message(), Vision("plain"))
    assert "No model here reads images" in alone.value.message


def test_ollama_images_become_parts_before_the_text():
    body = ollama.OllamaChat(4096).translate({"model": "m", "messages": [
        {"role": "user", "content": "what?", "images": [base64.b64encode(PNG).decode()]}]}, None).body
    assert body["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": DATA_URI}, openai_request.PART_NAME: "messages[0].images[0]"},
        {"type": "text", "text": "what?"}]


def test_an_anthropic_image_block_becomes_a_part():
    body = anthropic.translate_messages({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(PNG).decode()}},
        {"type": "text", "text": "what?"}]}]}, 4096)
    assert body["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": DATA_URI},
                                                 openai_request.PART_NAME: "messages.0.content.0"}


# ----- the library and the projector file -----------------------------------------------------


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("projector") / "mmproj-tiny.gguf"
    write_tiny_projector(path, text_width=576)
    return path


def test_the_projector_file_reads_as_clip_cpp_would(projector):
    info = read_projector_info(projector)
    assert (info.projector_type, info.width, info.output_width, info.tokens_per_image) == ("mlp", 64, 576,
                                                                                         image_tokens())


def test_a_projector_for_another_width_is_refused_by_name(projector):
    model = SimpleNamespace(n_embd=2048, path=Path("other.gguf"))
    with pytest.raises(ModelFileError, match="576-wide embeddings but the model other.gguf is 2048 wide"):
        read_paired_projector(projector, model)


def test_a_projector_beside_a_model_pairs_with_it_and_is_not_a_model(tmp_path, projector):
    model = tmp_path / "llava.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "mmproj-llava-f16.gguf").write_bytes(projector.read_bytes())
    assert projector_beside(model) == tmp_path / "mmproj-llava-f16.gguf"
    assert gguf_files(tmp_path) == [model]
    # A folder of several models says nothing of whose projector it is: none of them sees.
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    assert projector_beside(model) is None


def _config(tmp_path: Path, **model_keys):
    from tray_app.core.config import Config, ModelConfig, ModelEntry
    default = tmp_path / "default" / "base.gguf"
    default.parent.mkdir()
    default.write_bytes(b"GGUF")
    entry = ModelEntry(name="eyes", path=str(tmp_path / "eyes.gguf"), **model_keys)
    return Config(model=ModelConfig(path=str(default), folder=str(tmp_path / "none")), models=(entry,))


def test_an_mmproj_entry_pairs_a_projector_with_a_configured_model(tmp_path, projector):
    library = build_library(_config(tmp_path, mmproj=str(projector)))
    eyes = library.resolve("eyes")
    assert (eyes.mmproj, eyes.cpu_mmproj) == (projector, projector)
    assert eyes.sees_images and not library.default.sees_images


def test_a_smaller_cpu_fallback_needs_its_own_projector(tmp_path, projector):
    fallback = tmp_path / "small" / "small.gguf"
    fallback.parent.mkdir()
    fallback.write_bytes(b"GGUF")
    eyes = build_library(_config(tmp_path, mmproj=str(projector), cpu_fallback=str(fallback))).resolve("eyes")
    assert (eyes.mmproj, eyes.cpu_mmproj) == (projector, None)


# ----- memory and the worker's flags ------------------------------------------------------------


def test_the_estimate_counts_the_projector_where_it_runs(projector):
    info = read_projector_info(projector)
    need = estimate.projector_need(info, IMAGE_MAX_TOKENS)
    assert need.weights == info.weights_bytes
    # A fixed-size encoder (mlp) makes 16 tokens whatever the cap: the buffer is sized for 16.
    assert need.compute == estimate.projector_need(info, 0).compute
    assert need.compute < 1024 * 1024
    text = estimate.WorkerSettings(n_ctx=2048, n_gpu_layers=0, logits_all=False)
    info_text = read_model_info(bundled_model_path())
    cpu = estimate.estimate_worker(info_text, text)
    cpu_seeing = estimate.estimate_worker(info_text, replace(text, projector=info, image_max_tokens=IMAGE_MAX_TOKENS))
    # The RSS the tiny projector added to the bundled llama-server: 5.4 to 7.1 MiB.
    assert 7 * 1024 * 1024 < cpu_seeing.host.total - cpu.host.total < 10 * 1024 * 1024
    gpu = replace(text, n_gpu_layers=-1)
    gpu_seeing = estimate.estimate_worker(info_text, replace(gpu, projector=info))
    assert gpu_seeing.gpu.total - estimate.estimate_worker(info_text, gpu).gpu.total == need.weights + need.compute
    dynamic = replace(info, projector_type="qwen2vl")
    assert estimate.image_tokens_bound(dynamic, IMAGE_MAX_TOKENS) == IMAGE_MAX_TOKENS
    assert estimate.projector_need(dynamic, IMAGE_MAX_TOKENS).compute > 100 * need.compute


def test_the_worker_gets_the_projector_and_the_image_cap():
    runtime = LlamaServerRuntime(Path("/bin/llama-server"))
    launch = LaunchRequest(model_path=Path("m.gguf"), port=1, n_ctx=512, n_gpu_layers=0, n_batch=512, n_threads=0,
                           mmproj=Path("/models/mmproj.gguf"))
    argv = runtime.argv(launch)
    assert argv[argv.index("--mmproj") + 1] == "/models/mmproj.gguf"
    assert argv[argv.index("--image-max-tokens") + 1] == str(IMAGE_MAX_TOKENS)
    assert "--mmproj" not in runtime.argv(replace(launch, mmproj=None))


# ----- admission -------------------------------------------------------------------------------

LANE = LaneState(context_cap=4096, running=0, concurrency=1, queued=0, queue_limit=2)
GPU = GpuView(lane=LANE, out=None, free_vram_mib=2000, reserve_mib=512, request_vram_mib=50)
CPU = CpuView(lane=LANE, can_serve=True, out_reason=None, host_available_mib=16000, ram_floor_mib=1024,
              request_ram_mib=40, tokens_per_s=50.0, prompt_tokens_per_s=500.0, backlog_s=0.0)
BLIND = RequestShape(prompt_tokens=100, max_tokens=100, cpu_refusal="the CPU worker can't read images")


def test_an_image_the_cpu_cant_read_is_a_503_never_a_cpu_answer():
    down = replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "breaker open"))
    for shape in (BLIND, replace(BLIND, is_replay=True), replace(BLIND, force_cpu=True)):
        decision = decide(shape, down if not shape.force_cpu else GPU, CPU)
        assert (decision.route, decision.status, decision.reason) == (Route.REJECT, 503,
                                                                      Reason.CPU_CANNOT_READ_IMAGES)
        assert "can't read images" in decision.detail and decision.retry_after_s
    assert decide(BLIND, GPU, CPU).route is Route.GPU


def test_an_image_the_cpu_cant_read_waits_for_a_loading_gpu():
    loading = replace(GPU, out=GpuOut(Reason.GPU_LOADING, "loading", back_in_s=5.0))
    decision = decide(BLIND, loading, CPU)
    assert decision.route is Route.GPU_QUEUE and decision.waits_for_load


# ----- decoded size, read from the header -----------------------------------------------------

@pytest.mark.parametrize("kind", ["PNG", "JPEG", "GIF", "BMP"])
def test_an_images_pixels_are_read_from_its_header(kind):
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (321, 123), "white").save(buffer, kind, **({"exif": b"Exif\x00\x00" + b"\x00" * 5000}
                                                               if kind == "JPEG" else {}))
    assert image_pixels(buffer.getvalue()) == 321 * 123


def test_a_decompression_bomb_is_refused_before_any_worker_decodes_it():
    bomb = png_bomb(16000, 16000)
    assert len(bomb) < 1_000_000 and image_pixels(bomb) == 256_000_000
    uri = f"data:image/png;base64,{base64.b64encode(bomb).decode()}"
    with pytest.raises(InvalidRequest) as refused:
        flatten_content([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}], SEES)
    assert refused.value.code == "image_too_large" and "256.0 megapixels" in refused.value.message


def test_a_requests_images_count_together():
    six_mp = f"data:image/png;base64,{base64.b64encode(png_bomb(3000, 2000)).decode()}"
    parts = [{"type": "image_url", "image_url": {"url": six_mp}}]
    found = flatten_content([{"role": "user", "content": parts * 8}], SEES)
    assert found.pixels == 48_000_000
    with pytest.raises(InvalidRequest) as refused:
        flatten_content([{"role": "user", "content": parts * 9}], SEES)
    assert refused.value.param == "messages[0].content[8]" and "together" in refused.value.message
