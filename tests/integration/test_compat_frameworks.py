"""The agent frameworks and tools people point at a home server, at pinned
versions (pyproject's test extra), driven the way their users drive them,
against the real service on the small model.

The model's answers are noise; what is checked is the protocol: each call
the framework makes is answered in the shape it expects, a tool call comes
back when one is required, structured output parses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.integration

MODEL = "default"


class City(BaseModel):
    name: str
    population: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


# ----- OpenAI Agents SDK ------------------------------------------------------------------------


@pytest.fixture
def agents_sdk(fresh):
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces go to OpenAI's servers
    return AsyncOpenAI(base_url=f"{fresh.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_agents_sdk_required_tool_choice_calls_the_tool(agents_sdk, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool)
    from agents.items import ToolCallItem

    model = (OpenAIChatCompletionsModel(MODEL, agents_sdk) if api == "chat"
             else OpenAIResponsesModel(MODEL, agents_sdk))
    agent = Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[function_tool(get_weather)],
                  model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
    result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=3)
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert calls and calls[0].raw_item.name == "get_weather"


async def test_agents_sdk_structured_output_and_streaming(agents_sdk):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner

    agent = Agent(name="facts", instructions="Reply with a city.", output_type=City,
                  model=OpenAIChatCompletionsModel(MODEL, agents_sdk),
                  model_settings=ModelSettings(max_tokens=60, temperature=0))
    result = await Runner.run(agent, "Name a city and its population.")
    assert isinstance(result.final_output, City)
    streamed = Runner.run_streamed(Agent(name="chat", model=OpenAIChatCompletionsModel(MODEL, agents_sdk),
                                         model_settings=ModelSettings(max_tokens=8)), "Say hi.")
    events = [event async for event in streamed.stream_events()]
    assert events and isinstance(streamed.final_output, str)


# ----- LangChain --------------------------------------------------------------------------------


def test_langchain_openai_invoke_stream_tools_and_every_structured_output_method(fresh):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{fresh.url}/v1", api_key="unused", max_tokens=60, temperature=0,
                      max_retries=0)
    assert isinstance(chat.invoke("Say hi.").content, str)
    assert "".join(chunk.content for chunk in chat.stream("Say hi.")) is not None
    called = chat.bind_tools([get_weather], tool_choice="any").invoke("Weather in Oslo?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    prompt = "Name a city and its population, as JSON with name and population."
    for method in ("json_schema", "function_calling"):
        assert isinstance(chat.with_structured_output(City, method=method).invoke(prompt), City), method
    # json_mode promises JSON, not the schema (OpenAI's neither): it parses.
    raw = chat.with_structured_output(City, method="json_mode", include_raw=True).invoke(prompt)["raw"]
    assert isinstance(json.loads(raw.content), dict)


def test_langchain_openai_embeddings_send_text(fresh):
    """LangChain's default tokenizes with tiktoken's cl100k file, which it
    downloads at run time (no internet here, and those are OpenAI's token
    ids, not this model's); check_embedding_ctx_length=False sends the text,
    which is what works with any server that isn't OpenAI."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=MODEL, base_url=f"{fresh.url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    vectors = embeddings.embed_documents(["hello", "world"])
    assert len(vectors) == 2 and len(vectors[0]) == len(embeddings.embed_query("hi")) > 0


def test_langchain_ollama_invoke_stream_tools_structured_output_and_embeddings(fresh):
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    chat = ChatOllama(model=MODEL, base_url=fresh.url, num_predict=60, temperature=0)
    assert isinstance(chat.invoke("Say hi.").content, str)
    assert list(chat.stream("Say hi."))
    prompt = "Name a city and its population, as JSON with name and population."
    assert isinstance(chat.with_structured_output(City, method="json_schema").invoke(prompt), City)
    # Ollama's API has no tool_choice: function_calling gets a call only when the model
    # makes one (as on Ollama itself; SmolLM2 rarely does). The request must be answered.
    called = chat.with_structured_output(City, method="function_calling").invoke(prompt)
    assert called is None or isinstance(called, City)
    raw = chat.with_structured_output(City, method="json_mode", include_raw=True).invoke(prompt)["raw"]
    assert isinstance(json.loads(raw.content), dict)
    assert len(OllamaEmbeddings(model=MODEL, base_url=fresh.url).embed_query("hello")) > 0


# ----- LiteLLM and llm ------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["openai/", "ollama_chat/", "ollama/", "anthropic/"])
def test_litellm_routes(fresh, route, monkeypatch):
    # LiteLLM fetches its model price list from GitHub when imported, retrying for
    # seconds without internet; its bundled copy is what it falls back to anyway.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    base = f"{fresh.url}/v1" if route == "openai/" else fresh.url
    answer = litellm.completion(model=route + MODEL, api_base=base, api_key="unused", max_tokens=8,
                                messages=[{"role": "user", "content": "Say hi."}])
    assert isinstance(answer.choices[0].message.content, str)


def llm_command(fresh, *args: str) -> subprocess.CompletedProcess:
    """Simon Willison's `llm` CLI with llm-ollama, pointed here as its users do (OLLAMA_HOST)."""
    env = {**os.environ, "OLLAMA_HOST": fresh.url, "LLM_USER_PATH": str(fresh.tmp / "llm")}
    return subprocess.run([sys.executable, "-m", "llm", *args], env=env, capture_output=True, text=True, timeout=120)


def test_llm_chat_and_embed_through_llm_ollama(fresh):
    # llm-ollama names a model "ollama/<name>", and lists it for embedding only
    # when /api/show's capabilities say "embedding".
    model = "ollama/" + fresh.http.get("/api/tags").json()["models"][0]["name"]
    chatted = llm_command(fresh, "-m", model, "-o", "num_predict", "8", "Say hi.")
    assert chatted.returncode == 0, chatted.stderr
    embedded = llm_command(fresh, "embed", "-m", model, "-c", "hello")
    assert embedded.returncode == 0, embedded.stderr
    assert len(json.loads(embedded.stdout)) > 0


# ----- LlamaIndex -------------------------------------------------------------------------------

# Its own venv: llama-index-llms-openai needs openai<3 (packaging/install.sh --test makes it).
LLAMAINDEX_PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "llamaindex" / "bin" / "python"


def test_llamaindex_required_tool_call_structured_predict_and_chat(fresh):
    if not LLAMAINDEX_PYTHON.exists():
        pytest.skip(f"no LlamaIndex venv at {LLAMAINDEX_PYTHON} (packaging/install.sh --test makes it)")
    probe = Path(__file__).parent / "compat" / "llamaindex_probe.py"
    result = subprocess.run([str(LLAMAINDEX_PYTHON), str(probe), fresh.url], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["tool_calls"] == ["get_weather"]
    assert isinstance(seen["city"]["name"], str) and isinstance(seen["city"]["population"], int)
    assert isinstance(seen["chat"], str)
