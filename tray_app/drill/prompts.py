"""The drill's prompts. Fixed text, temperature 0: the same prompt must give
the same tokens on the GPU and the CPU path (same model file)."""

from __future__ import annotations

import math

SHORT_PROMPTS = (
    "List three colours.",
    "Name two planets.",
    "Say hello in five words.",
    "What is the capital of France?",
    "Give one tip for sleeping well.",
    "Count from one to five.",
    "Describe the sea in one sentence.",
    "Name a famous painter.",
)

COMPLETION_PROMPTS = (
    "The capital of France is",
    "Three primary colours are",
    "The largest planet is",
    "A good breakfast includes",
    "The sea is",
    "Once upon a time",
    "The best way to learn is",
    "My favourite season is",
)

# Long answers, for killing a worker while it generates.
STORY = "Write a long story about a lighthouse keeper and the sea."

# Questions with short answers, for requests whose max_tokens (not their
# prompt) takes them over the GPU context cap: admission counts the budget.
SHORT_ANSWER_QUESTIONS = (
    "What is 2 + 2? Answer with the number only.",
    "What is 3 + 4? Answer with the number only.",
    "What is 5 + 1? Answer with the number only.",
    "What is 6 + 2? Answer with the number only.",
)

OVER_CAP_QUESTIONS = (
    "Summarise the text above in one sentence.",
    "What is the text above about?",
    "Name one place mentioned above.",
    "Give the text above a title.",
)

_FILLER = (
    "The harbour town woke slowly under a grey sky. Fishing boats rocked against the old stone quay "
    "while gulls argued over the morning catch. At the end of the pier the lighthouse stood white and "
    "patient, its lamp dark after a long night of turning. The keeper climbed down the spiral stairs, "
    "counted the steps as he always did, and wrote the weather into his log: wind from the west, "
    "rain later, the sea calm for now. In the bakery the first loaves came out of the oven and the "
    "smell drifted along the narrow streets towards the market square, where traders unfolded their "
    "tables and argued about the price of apples. "
).split()


def filler(words: int) -> str:
    """`words` words of plain English prose (repeated as needed)."""
    repeats = math.ceil(words / len(_FILLER)) if words > 0 else 0
    return " ".join((_FILLER * repeats)[:words])


def sized_message(words: int, question: str) -> str:
    return f"{filler(words)}\n\n{question}" if words else question


class PromptSizer:
    """Turns a token target into a prompt, from two calibration requests.

    The service counts prompt tokens with the model's tokenizer and chat
    template and reports them in `usage`; the drill measures tokens per filler
    word once instead of loading a tokenizer, so it sizes prompts the same way
    against a live service on another machine.
    """

    CALIBRATION_WORDS = 60

    def __init__(self, base_tokens: int, tokens_with_filler: int) -> None:
        self.base_tokens = base_tokens
        self.tokens_per_word = max(0.5, (tokens_with_filler - base_tokens) / self.CALIBRATION_WORDS)

    def words_for(self, prompt_tokens: int) -> int:
        return max(0, math.ceil((prompt_tokens - self.base_tokens) / self.tokens_per_word))

    def message(self, prompt_tokens: int, question: str) -> str:
        return sized_message(self.words_for(prompt_tokens), question)
