"""attention_backend."""
