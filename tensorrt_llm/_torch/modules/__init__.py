"""modules."""
