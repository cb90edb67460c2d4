"""Command-line tools: model acquisition (fetch, GGUF conversion)."""
