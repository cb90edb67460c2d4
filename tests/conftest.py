"""Shared fixtures: tiny random HF checkpoints (Llama, Qwen2) with a tiny trained tokenizer,
the real SmolLM2 folder when present, an `LLM` factory, and HF reference helpers.

The tiny checkpoints are written by transformers itself (`save_pretrained`), so the engine's
loader and the HF reference read exactly the same files. Weights are re-drawn larger than
HF's init, and norms / biases made non-trivial, so greedy text is varied (not one repeated
token), top-1 margins dwarf fp32 rounding, and a dropped bias or norm weight cannot go unnoticed.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (the TRITON attention backend) run in Triton's interpreter on a CPU-only
    # machine; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

REAL_MODEL_DIR = Path.home() / ".cache" / "tensorrt_llm" / "models" / "smollm2-135m-instruct"

TINY_VOCAB = 512          # config vocab; the trained tokenizer uses fewer ids (the rest never decode)
TOKENIZER_VOCAB = 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2     # as in SmolLM2: <|im_start|> / <|im_end|>
TINY_ROPE_THETA = {"llama": 1000.0, "qwen2": 1_000_000.0}   # non-default on purpose
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{'<|im_start|>assistant\n'}}{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! what is the capital of france? paris is.",
    "a paged kv cache holds keys and values in fixed size blocks",
    "speculative decoding drafts several tokens and the target verifies them",
    "once upon a time there was a tiny model that generated text",
    "0123456789 + - * / = ( ) [ ] { } : ; , . ? !",
] * 8

# Prompts used by the tests on the tiny model (short; varied lengths come from repeating them).
TINY_PROMPTS = [
    "the quick brown fox",
    "hello world, what is the capital of france?",
    "a paged kv cache holds keys and values in fixed size blocks and the target verifies them",
    "once upon a time",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- tiny checkpoint ----------------------------------------------------------------------
def write_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE (vocab <= TOKENIZER_VOCAB) + tokenizer_config + generation_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    assert tk.get_vocab_size() <= TINY_VOCAB
    assert [tk.token_to_id(s) for s in SPECIALS] == [0, BOS_ID, EOS_ID]
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID], "pad_token": SPECIALS[EOS_ID], "chat_template": CHAT_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(2.0 * noise * p.shape[-1] ** -0.5)


def write_tiny_checkpoint(folder: Path, arch: str = "llama", num_layers: int = 3, seed: int = 0,
                          rope_parameters: dict | None = None) -> Path:
    """Write a tiny random HF checkpoint (`save_pretrained`, safetensors) + tokenizer."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                  max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  rope_parameters=rope_parameters or {"rope_type": "default",
                                                      "rope_theta": TINY_ROPE_THETA[arch]})
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def write_checkpoint() -> Callable[..., Path]:
    """`write_tiny_checkpoint(folder, arch, num_layers, seed, rope_parameters)` for custom variants."""
    return write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Tiny Llama (3 layers, hidden 64, 4 heads, 2 KV heads, vocab 512, tied embeddings)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Tiny Qwen2 (as the Llama, plus random q/k/v biases)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def llama64_dir(tiny_llama_dir, tmp_path_factory):
    """Tiny random Llama: 2 layers, hidden 256, 4 heads x 64, 2 KV heads, vocab 512 (bf16-friendly)."""
    import shutil

    import transformers

    folder = tmp_path_factory.mktemp("llama64")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5, rope_theta=1000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():       # larger-than-init weights: peaky logits, non-trivial norms
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else
                    noise if "embed_tokens" in name else noise * p.shape[-1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_llama_dir / f, folder / f)
    return folder


@pytest.fixture
def tiny_checkpoint_copy(tiny_llama_dir, tmp_path) -> Path:
    """A private copy of the tiny Llama that a test may break."""
    import shutil
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder; skips when it was never fetched."""
    if not (REAL_MODEL_DIR / "config.json").is_file() or not (REAL_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"real model not present at {REAL_MODEL_DIR} (run trtllm-fetch-model smollm2-135m-instruct)")
    return REAL_MODEL_DIR


# ---- engine + HF reference ----------------------------------------------------------------
@pytest.fixture
def make_llm() -> Callable:
    """Factory `make_llm(path, **TorchLlmArgs)` on CPU; every LLM made is shut down afterwards."""
    from tensorrt_llm import LLM

    made = []

    def make(path, **kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("kv_cache_config", {"max_tokens": 4096, "tokens_per_block": 16})
        llm = LLM(str(path), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


_HF_CACHE: dict[str, torch.nn.Module] = {}


def load_hf_model(path: Path) -> torch.nn.Module:
    """transformers' own model for a checkpoint folder (fp32, eager attention), cached per session."""
    import transformers

    key = str(path)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
    return _HF_CACHE[key]


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)` for exactly `max_new_tokens` (EOS does not stop it)."""
    import transformers

    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                       eos_token_id=[], pad_token_id=0)
    out = model.generate(torch.tensor([prompt_ids]), generation_config=gc,
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt), V] float32 logits of the whole prompt from transformers."""
    return model(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="session")
def hf_reference():
    """(load_hf_model, hf_logits, hf_greedy) helpers as one namespace."""
    import types
    return types.SimpleNamespace(load=load_hf_model, logits=hf_logits, greedy=hf_greedy)


def run_bounded(fn: Callable, timeout: float = 60.0):
    """Run `fn()` on a daemon thread; fail (instead of hanging the suite) if it blocks too long."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"blocked for more than {timeout} s (a stream that never finishes?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture(scope="session")
def bounded() -> Callable:
    """`bounded(fn, timeout=60)`: fn() on a daemon thread, failing the test if it hangs."""
    return run_bounded


@pytest.fixture(scope="session")
def tiny_prompts() -> list[str]:
    return list(TINY_PROMPTS)


@pytest.fixture(scope="session")
def tiny_drafters(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    """Tiny random DSpark drafters {"gqa", "mla"} for the tiny Llama (checkpoint folders)."""
    from tensorrt_llm._torch.models.checkpoint import read_config
    from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
    from tensorrt_llm._torch.models.modeling_llama import LlamaConfig

    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "target")
    out = {}
    for kind in ("gqa", "mla"):
        folder = tmp_path_factory.mktemp(f"tiny_drafter_{kind}")
        DSparkForCausalLMBase.random_init(kind, tc, seed=3, markov_rank=4).save_pretrained(folder)
        out[kind] = str(folder)
    return out



@pytest.fixture
def no_device_syncs() -> Callable:
    """`with no_device_syncs(): ...` raises on any torch op that blocks on the GPU
    (torch.cuda.set_sync_debug_mode("error")); the mode is reset on exit. Callers pair it with a
    control that shows a blocking read does raise."""
    @contextlib.contextmanager
    def forbid():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return forbid


@pytest.fixture(scope="session")
def dspark_ops(tmp_path_factory):
    """`torch.ops.trtllm` with the DSpark C++ ops registered: the built library when present, else a
    JIT build of cpp/ (the CUDA kernels too where CUDA and nvcc are; the namespace is registered once
    per process). Skips without ninja or a C++ compiler."""
    import shutil
    import subprocess
    import sys

    from tensorrt_llm._torch.attention_backend import cpp_ops
    if not cpp_ops.ops_loaded():
        from torch.utils import cpp_extension
        bin_dir = str(Path(sys.executable).parent)        # the venv's ninja
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        if shutil.which("ninja") is None or shutil.which("c++") is None:
            pytest.skip("building the C++ ops needs ninja and a C++ compiler")
        cpp = Path(__file__).resolve().parents[1] / "cpp"
        sources = [cpp / "dspark_ops.cpp"]
        if torch.cuda.is_available() and torch.version.cuda and shutil.which("nvcc"):
            sources.append(cpp / "dspark_ops_kernels.cu")
        try:
            cpp_extension.load(name="dspark_ops_test", sources=[str(s) for s in sources], is_python_module=False,
                               build_directory=str(tmp_path_factory.mktemp("dspark_ops_build")),
                               extra_cflags=["-O2"], verbose=False)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:   # a toolchain that cannot build torch extensions
            pytest.skip(f"building the C++ ops failed on this machine: {str(e)[-300:]}")
        cpp_ops._loaded = None
        assert cpp_ops.ops_loaded()
    return torch.ops.trtllm
