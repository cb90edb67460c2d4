"""pyexecutor."""
