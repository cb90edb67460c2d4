"""Cross-check the real converted SmolLM2 against transformers' own GGUF loader.

Skipped unless ``trtllm-fetch-model smollm2-135m-instruct`` has already populated the default cache
(unit tests never download). transformers reads the same ``.gguf`` (kept in the folder) with its
own tokenizer builder and its own q/k un-permutation; both must agree with ours.

Tensors come from ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``: the function
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` uses, called directly because
``from_pretrained`` additionally insists on ``accelerate`` being installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm.tools.fetch_model import MODEL_REGISTRY, default_cache_dir, is_complete

NAME = "smollm2-135m-instruct"
FOLDER = default_cache_dir() / NAME
SOURCE = MODEL_REGISTRY[NAME]
GGUF_FILE = Path(SOURCE.wheel_member).name

pytestmark = pytest.mark.skipif(
    not is_complete(FOLDER, NAME, SOURCE) or not (FOLDER / GGUF_FILE).is_file(),
    reason=f"run `trtllm-fetch-model {NAME}` first (needs {FOLDER})",
)

TEXTS = [
    "Hello world!",
    "What is the capital of France?",
    "  leading spaces\n\nand tabs\t 12345 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "héllo wörld 日本語 🤖 don't I'll we've",
]


def test_tokenizer_matches_transformers_gguf_tokenizer():
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(FOLDER, gguf_file=GGUF_FILE)
    ours = transformers.AutoTokenizer.from_pretrained(FOLDER)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == text


def test_tensors_match_transformers_gguf_loader():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_file(FOLDER / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(FOLDER)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(FOLDER / GGUF_FILE), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        np.testing.assert_allclose(ours[name], ref.float().numpy(), rtol=0, atol=1e-6, err_msg=name)
    # Negative control: a q projection left in llama.cpp's layout differs from transformers'.
    q = "model.layers.0.self_attn.q_proj.weight"
    from tensorrt_llm.tools.convert_gguf import permute_qk

    assert np.abs(permute_qk(ours[q], config.num_attention_heads) - theirs[q].float().numpy()).max() > 1e-3
