"""Which fields of a request reach llama-server: the one rule, written once.

llama-server reads dozens of request fields, and some of them reach code that
asserts instead of answering: `grammar_triggers` with an unknown type is a
GGML_ASSERT (SIGABRT) in common/sampling.cpp, a `repeat_last_n` of 2^31 asks
the penalty sampler for an 8 GiB ring buffer, `chat_format` is cast to an
enum unchecked. A request that kills one worker kills the other on the
replay, so what reaches a worker must be only what the service has checked.

The rule, for every route (OpenAI's chat and completions, llama.cpp's
/completion, and the bodies that Ollama's, Anthropic's and OpenAI's Responses
routes translate into OpenAI's):

1. A field in FORWARDED for the request's kind is checked against its bound
   (api/bounds.py, api/requests.py) and sent on. Nothing else is ever sent:
   `for_worker` builds the worker's body from this list alone, so a field
   that a check forgot still can't reach llama-server.
2. A field llama-server reads that the service does not forward
   (LLAMA_SERVER_ONLY) is refused with a 400 naming it and saying what to
   send instead: a client that sends one expects it to act, and silently
   dropping it would change the answer. At llama-server's own default (or
   null, which llama-server reads as absent) it changes nothing, so it is
   dropped instead: front ends that write every field keep working.
3. Any other field is the client's own or another API's: the service reads
   the ones it knows (`model`, `user`, `stream_options`...) and ignores the
   rest, as llama-server itself does and as OpenAI-compatible servers do.

The protocols that translate (Ollama, Anthropic, Responses) build their
OpenAI body from the fields they know, so rule 3 is theirs already: what
their API doesn't define never enters the translated body.
"""

from __future__ import annotations

from typing import Any

# Sampling fields every kind forwards, each bounded in api/bounds.py.
_SAMPLING = frozenset({
    "temperature", "top_p", "min_p", "typical_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
    "repeat_penalty",
    # llama.cpp's own samplers, which SillyTavern and other llama.cpp front
    # ends send (bounded in bounds.LLAMA_SAMPLING and bounds.samplers_problem).
    "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent",
    "xtc_probability", "xtc_threshold", "top_n_sigma", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "min_keep", "ignore_eos", "samplers",
})

# Set by the service itself (worker_body): the limit admission planned with,
# always streamed, the grammar the checker's child produced, logprobs as the
# service asks for them, no prompt cache for a key that asked for none, and
# the prompt's progress (the hang deadline's evidence while a prompt is read).
_SERVICE_SET = frozenset({"max_tokens", "stream", "grammar", "logprobs", "top_logprobs", "cache_prompt",
                          "return_progress"})

_COMMON = _SAMPLING | _SERVICE_SET | frozenset({"stop", "logit_bias", "n"})

FORWARDED: dict[str, frozenset[str]] = {
    "chat": _COMMON | frozenset({
        "messages", "tools", "tool_choice", "parallel_tool_calls",
        "reasoning_format", "reasoning_effort", "reasoning_budget_tokens", "chat_template_kwargs",
    }),
    "completion": _COMMON | frozenset({"prompt"}),
}

# llama-server's fields that the service does not forward: why, or what to
# send instead, and the values that leave llama-server's behaviour as it is
# (dropped rather than refused). Read off the vendored server's request
# schema (tools/server/server-schema.cpp) and chat parameters
# (server-common.cpp). n_predict and json_schema are translated, not
# refused, on llama.cpp's own /completion route (api/llamacpp.py).
_SHAPE = "responses have OpenAI's shape here"
_TEMPLATE = "the chat template and its parser are the model's own here"
_GRAMMAR = "send response_format, a grammar, or a tool_choice"
_CONTEXT = "the context is the service's to manage"
LLAMA_SERVER_ONLY: dict[str, tuple[str, tuple[Any, ...]]] = {
    "n_predict": ("send max_tokens", ()),
    "n_cmpl": ("send n", (1,)),
    "id_slot": ("slots are the service's to assign", (-1,)),
    "n_probs": ("send logprobs and top_logprobs", (0,)),
    "json_schema": ("send response_format", ()),
    "response_fields": (_SHAPE, ()),
    "return_progress": (_SHAPE, (False,)),
    "return_tokens": (_SHAPE, (False,)),
    "post_sampling_probs": ("send logprobs and top_logprobs", (False,)),
    "timings_per_token": (_SHAPE, (False,)),
    "verbose": (_SHAPE, (False,)),
    "sse_ping_interval": ("the service keeps its own streams alive", ()),
    "grammar_triggers": (_GRAMMAR, ([],)),
    "grammar_lazy": (_GRAMMAR, (False,)),
    "grammar_type": (_GRAMMAR, ()),
    "preserved_tokens": (_GRAMMAR, ([],)),
    "chat_format": (_TEMPLATE, ()),
    "chat_parser": (_TEMPLATE, ()),
    "generation_prompt": (_TEMPLATE, ()),
    "parse_tool_calls": (_TEMPLATE, ()),
    "add_generation_prompt": (_TEMPLATE, (True,)),
    "continue_final_message": (_TEMPLATE, (False,)),
    "echo": ("the answer holds only what the model wrote", (False,)),
    "reasoning_control": ("send reasoning_effort or reasoning_budget_tokens", ()),
    "reasoning_budget_start_tag": (_TEMPLATE, ()),
    "reasoning_budget_end_tags": (_TEMPLATE, ()),
    "reasoning_budget_end_tag": (_TEMPLATE, ()),
    "reasoning_budget_message": (_TEMPLATE, ()),
    "thinking_budget_tokens": ("send reasoning_budget_tokens", ()),
    "lora": ("adapters are the server's configuration", ([],)),
    "n_keep": (_CONTEXT, (0,)),
    "n_discard": (_CONTEXT, (0,)),
    "n_cache_reuse": (_CONTEXT, (0,)),
    "n_indent": ("not supported here", (0,)),
    "t_max_predict_ms": ("send X-Request-Timeout", (-1, 0)),
    "t_max_prompt_ms": ("send X-Request-Timeout", (-1, 0)),
    "backend_sampling": ("not supported here", (False,)),
    "adaptive_target": ("not supported here", ()),
    "adaptive_decay": ("not supported here", ()),
    "input_prefix": ("infill is not served here", ("",)),
    "input_suffix": ("infill is not served here", ("",)),
    "input_extra": ("infill is not served here", ([],)),
    "multimodal_data": ("send images as content parts of a chat message", ()),
    "image_data": ("send images as content parts of a chat message", ([],)),
    # The vendored llama-server reads no per-request speculative field (its
    # schema has them compiled out): a request can't turn drafting on, off
    # or wider, and a silent drop would let a client believe it did.
    **{f"speculative.{name}": ("speculative decoding is set per path here ([gpu]/[cpu] speculative), "
                               "and this llama.cpp takes no per-request setting", ())
       for name in ("n_max", "n_min", "p_min", "type", "ngram_size_n", "ngram_size_m", "ngram_min_hits")},
    # The service caches prompts on both workers anyway (a key made with
    # --no-prompt-cache never does): any true or false is neutral.
    "cache_prompt": ("send true or false", (True, False)),
}


def is_neutral(field: str, value: Any) -> bool:
    """The value of a llama-server-only field leaves its behaviour as it is."""
    if value is None:
        return True
    _, neutral = LLAMA_SERVER_ONLY[field]
    # type() too: JSON's 0 and false are both in Python's `0 == False`.
    return any(value == n and type(value) is type(n) for n in neutral)


def refusal(field: str) -> str:
    """The 400's message for a llama-server-only field at a value that acts."""
    why, _ = LLAMA_SERVER_ONLY[field]
    return f"'{field}' is a llama-server field this service does not pass on: {why}"


def for_worker(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fields of a checked body that a worker gets (rule 1)."""
    allowed = FORWARDED[kind]
    return {key: value for key, value in body.items() if key in allowed}
