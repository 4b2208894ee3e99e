"""Run in the LlamaIndex venv (.venv/llamaindex: it needs openai<3, which the
main test venv's frameworks don't take). Drives LlamaIndex as its users do
against the service at argv[1], and prints one JSON line of what came back."""

import json
import sys

from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel


class City(BaseModel):
    name: str
    population: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


llm = OpenAILike(model="default", api_base=f"{sys.argv[1]}/v1", api_key="unused", is_chat_model=True,
                 is_function_calling_model=True, max_tokens=80, temperature=0, max_retries=0, timeout=300)
tool = FunctionTool.from_defaults(fn=get_weather)
response = llm.chat_with_tools([tool], user_msg="What is the weather in Oslo?", tool_required=True)
calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
city = llm.structured_predict(City, PromptTemplate("Name a city and its population."))
plain = llm.chat([ChatMessage(role="user", content="Say hi.")])
print(json.dumps({"tool_calls": [c.tool_name for c in calls], "city": city.model_dump(),
                  "chat": plain.message.content}))
