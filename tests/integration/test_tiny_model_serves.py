"""The tiny random-weight model the GPU check writes is a model llama.cpp
serves: the bundled llama-server loads it with a long context and applies
SmolLM2's chat template, and its tokenizer is the bundled model's."""

from __future__ import annotations

import httpx
import llama_cpp
import pytest

from benchmarks.anchors import llama_server
from benchmarks.gpu_check import tiny_model
from tray_app.core.config import bundled_model_path

pytestmark = pytest.mark.integration

N_CTX = 65_536
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model.export_tokenizer(bundled_model_path(), folder / "tokenizer.json.gz")
    tiny_model.write_tiny_model(folder / "tokenizer.json.gz", folder / "tiny.gguf")
    return folder / "tiny.gguf"


@pytest.fixture(scope="module")
def server(tiny):
    anchor = llama_server(tiny.parent / "llama-server.log", n_ctx=N_CTX, parallel=1, model=tiny)
    try:
        yield anchor
    finally:
        anchor.stop()


def test_llama_server_loads_it_with_a_long_context_and_answers_a_chat(server):
    # The KV cache, allocated at load for the whole context, is 2 KiB a token: 128 MiB here.
    props = httpx.get(f"{server.url}/props", timeout=10).json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX

    template = httpx.post(f"{server.url}/apply-template", json={"messages": HELLO}, timeout=10).json()
    assert template["prompt"].endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")

    reply = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"messages": HELLO, "max_tokens": 8, "temperature": 0}, timeout=30).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    assert isinstance(choice["message"]["content"], str)
    assert 0 < reply["usage"]["completion_tokens"] <= 8


def test_its_tokenizer_is_the_bundled_models(tiny):
    ours = llama_cpp.Llama(str(tiny), vocab_only=True, verbose=False)
    bundled = llama_cpp.Llama(str(bundled_model_path()), vocab_only=True, verbose=False)
    for text in (b"Hello world", "<|im_start|>user\nCaf\u00e9 \u00fcber 1234 \U0001f600<|im_end|>\n".encode()):
        assert ours.tokenize(text, special=True) == bundled.tokenize(text, special=True)
    assert ours.tokenize(b"Hello world", add_bos=False) == [19556, 905]
    assert (ours.n_vocab(), ours.token_bos(), ours.token_eos()) == (bundled.n_vocab(), bundled.token_bos(),
                                                                   bundled.token_eos())
