"""TensorRT-LLM-shaped PyTorch serving engine."""
