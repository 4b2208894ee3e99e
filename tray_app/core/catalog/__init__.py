"""The model catalog: which GGUF models there are (library), fetching one from a hub
(download), and counting a prompt with a model's own tokenizer (tokens)."""
