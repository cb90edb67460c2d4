"""Bad checkpoint folders fail at load with a ValueError naming the file and the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm import LLM, SamplingParams


def _edit_config(folder: Path, **changes) -> None:
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _load(folder: Path) -> LLM:
    return LLM(str(folder), device="cpu", kv_cache_config={"max_tokens": 128})


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match=r"not found.*nope"):
        _load(tmp_path / "nope")


def test_missing_config_json(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        _load(tiny_checkpoint_copy)


def test_invalid_config_json(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.*invalid JSON"):
        _load(tiny_checkpoint_copy)


def test_missing_required_config_key(tiny_checkpoint_copy):
    _edit_config(tiny_checkpoint_copy, hidden_size=None)
    with pytest.raises(ValueError, match=r"config\.json.*'hidden_size'"):
        _load(tiny_checkpoint_copy)


def test_unknown_architecture(tiny_checkpoint_copy):
    _edit_config(tiny_checkpoint_copy, architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match=r"config\.json.*MambaForCausalLM"):
        _load(tiny_checkpoint_copy)


def test_missing_tensor(tiny_checkpoint_copy):
    _edit_tensors(tiny_checkpoint_copy, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(tiny_checkpoint_copy)


def test_unexpected_tensor(tiny_checkpoint_copy):
    _edit_tensors(tiny_checkpoint_copy,
                  lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    with pytest.raises(ValueError, match=r"unexpected tensors.*rotary_emb\.inv_freq"):
        _load(tiny_checkpoint_copy)


def test_shape_mismatch(tiny_checkpoint_copy):
    _edit_tensors(tiny_checkpoint_copy, lambda s: s.__setitem__("model.norm.weight", torch.ones(32)))
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.norm\.weight'.*\(32,\).*\(64,\)"):
        _load(tiny_checkpoint_copy)


def test_no_safetensors(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        _load(tiny_checkpoint_copy)


def test_corrupt_safetensors(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(tiny_checkpoint_copy)


def test_missing_tokenizer(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        _load(tiny_checkpoint_copy)


def test_untied_lm_head_is_loaded_not_ignored(tiny_checkpoint_copy):
    """An untied checkpoint's lm_head is a real tensor: it must be loaded (and required)."""
    head = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    _edit_config(tiny_checkpoint_copy, tie_word_embeddings=False)
    _edit_tensors(tiny_checkpoint_copy, lambda s: s.__setitem__("lm_head.weight", head))
    llm = _load(tiny_checkpoint_copy)
    try:
        model = llm._bundle.model
        assert torch.equal(model.lm_head.weight.detach(), head)
        assert not torch.equal(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach())
    finally:
        llm.shutdown()
    _edit_tensors(tiny_checkpoint_copy, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*lm_head\.weight"):
        _load(tiny_checkpoint_copy)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_names_file_and_tensor(tiny_checkpoint_copy, value):
    """Issue #19 item 7: a NaN/Inf target weight used to load silently (and generate garbage); it
    raises naming the file and the tensor. Negative control: test_good_checkpoint_still_loads."""
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_tensors(tiny_checkpoint_copy, lambda s: s[name].__setitem__((3, 5), value))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight' "
                                         r"has 1 non-finite value\(s\) \(NaN/Inf\) of 8192"):
        _load(tiny_checkpoint_copy)


def test_good_checkpoint_still_loads(tiny_checkpoint_copy):
    llm = _load(tiny_checkpoint_copy)
    try:
        assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=2)).outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
