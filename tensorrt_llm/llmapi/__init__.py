"""LLM API: `LLM`, `SamplingParams`, configs."""
from ..sampling_params import SamplingParams
from .llm import LLM
from .llm_args import DSparkDecodingConfig, KvCacheConfig, TorchLlmArgs
from .outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "KvCacheConfig", "TorchLlmArgs", "DSparkDecodingConfig",
           "RequestOutput", "CompletionOutput"]
