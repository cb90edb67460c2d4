"""TensorRT-LLM-shaped PyTorch serving engine with DSpark block-draft speculative decoding."""
from .llmapi import LLM, DSparkDecodingConfig, KvCacheConfig, SamplingParams, TorchCompileConfig, TorchLlmArgs

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "KvCacheConfig", "TorchLlmArgs", "TorchCompileConfig", "DSparkDecodingConfig"]
