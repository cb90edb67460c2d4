from setuptools import find_packages, setup


def dspark_extension() -> dict:
    """The DSpark C++/CUDA ops (cpp/) as `tensorrt_llm/_dspark_ops*.so`, built where a CUDA torch and
    a CUDA toolchain are present; skipped without error elsewhere (CPU installs keep the reference)."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:          # an isolated build without torch
        return {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return {}
    ext = CUDAExtension("tensorrt_llm._dspark_ops", ["cpp/dspark_ops.cpp", "cpp/dspark_ops_kernels.cu"],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}}


setup(
    name="tensorrt_llm",
    version="0.1.0",
    description="TensorRT-LLM-shaped PyTorch serving engine with DSpark block-draft speculative decoding",
    packages=find_packages(include=["tensorrt_llm", "tensorrt_llm.*"]),
    python_requires=">=3.10",
    # torch is constrained, not pinned: CPU installs pre-install torch==2.13.0 (Makefile),
    # the GPU image brings its own CUDA build.
    install_requires=[
        "torch>=2.4",
        "numpy",
        "pydantic>=2.5",
        "pyyaml",
        "safetensors",
        "tokenizers>=0.19",
        "gguf>=0.10",
        "jinja2",
        "tqdm",
        "fastapi>=0.115",
        "uvicorn>=0.30",
        "prometheus-client>=0.20",
        "httpx>=0.27",
    ],
    extras_require={
        "gpu": ["flashinfer-python==0.7.2.post1"],
        # triton: the TRITON kernels' CPU tests run in Triton's interpreter (CUDA wheels of torch ship it)
        # ninja: the C++ ops' CPU tests build cpp/dspark_ops.cpp with torch.utils.cpp_extension
        "test": ["pytest>=8", "transformers>=4.45", "openai>=1.40", "triton>=3.2", "ninja"],
        # the CuTe DSL norm + RoPE prep kernel (attention_backend: CUTEDSL, sm90+); CI installs it so that the
        # kernel's CPU test compiles it for sm_90a (~100 MB of wheels)
        "cutedsl": ["nvidia-cutlass-dsl==4.8.1", "apache-tvm-ffi==0.1.15.post2"],
        # GSM8K through the server (tensorrt_llm/bench/lm_eval_gsm8k.py); heavy, not installed by CI
        "eval": ["lm-eval[api]==0.4.13", "transformers>=4.45", "accelerate"],
    },
    entry_points={
        "console_scripts": [
            "trtllm-fetch-model=tensorrt_llm.tools.fetch_model:main",
            "trtllm-convert-gguf=tensorrt_llm.tools.convert_gguf:main",
            "trtllm-bench=tensorrt_llm.bench.benchmark:main",
            "trtllm-serve=tensorrt_llm.serve.cli:main",
            "trtllm-train-dspark=tensorrt_llm.tools.train_dspark:main",
        ],
    },
    **dspark_extension(),
)
