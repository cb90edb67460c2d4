"""`trtllm-serve`: an OpenAI-compatible server (FastAPI + uvicorn) over `LLM`; see docs/serving.md."""
from .app import create_app

__all__ = ["create_app"]
