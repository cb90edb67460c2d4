"""llmapi."""
