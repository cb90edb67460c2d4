"""LLM API: `LLM`, `SamplingParams`, configs."""
from ..sampling_params import SamplingParams
from .llm import LLM
from .llm_args import DSparkDecodingConfig, KvCacheConfig, TorchCompileConfig, TorchLlmArgs
from .outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "KvCacheConfig", "TorchLlmArgs", "TorchCompileConfig", "DSparkDecodingConfig",
           "RequestOutput", "CompletionOutput"]
