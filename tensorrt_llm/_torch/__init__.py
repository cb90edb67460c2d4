"""_torch."""
