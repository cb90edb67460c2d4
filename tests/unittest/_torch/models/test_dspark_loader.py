"""`dspark_loader.load_drafter`: checkpoints round-trip bit-exactly, and every malformed file, key,
shape, value or config is refused with a message naming it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm._torch.models.dspark_loader import DRAFTER_REGISTRY, load_drafter
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tests.unittest._torch.models.dspark_fixtures import (CPU, F32, HIDDEN, VOCAB, Paged, drafter, make_inputs,
                                                          run_paged, target_config)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(target_config()).eval()


def save(kind: str, target, folder: Path, **ov) -> DSparkForCausalLMBase:
    d = drafter(kind, target, seed=6, **ov)
    d.save_pretrained(folder)
    return d


def edit_state(folder: Path, fn) -> None:
    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"))


def edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def load(folder: Path, tcfg: LlamaConfig | None = None, **ov):
    return load_drafter(folder, tcfg or target_config(), F32, CPU, overrides=ov)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_round_trip_identical_outputs(kind, target, tmp_path):
    g = torch.Generator().manual_seed(7)
    d = save(kind, target, tmp_path, markov_rank=4)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert "markov_head.w1.weight" in keys
    d2 = load(tmp_path)
    assert type(d2) is DRAFTER_REGISTRY[d.config.architecture] and d2.config == d.config
    d2.bind_target(target.model.embed_tokens, target.lm_head)
    paged = Paged([6, 11], blk=4, g=g)
    th, blocks, anchors = make_inputs(d, paged, g)
    h1, h2 = run_paged(d, paged, th, blocks), run_paged(d2, paged, th, blocks)
    assert torch.equal(h1, h2)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(d.propose(h1, anchors, 4), d2.propose(h2, anchors, 4)))


def test_reject_missing_tensor(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_state(tmp_path, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"):
        load(tmp_path)


@pytest.mark.parametrize("kind,value", [("gqa", float("nan")), ("mla", float("-inf"))])
def test_reject_non_finite_weight(kind, value, target, tmp_path):
    """Issue #19 item 7: a drafter with a NaN/Inf weight used to load silently (and then accept no
    draft, AL 1.0 forever); it raises naming the file and the tensor. Negative control: the same
    checkpoint before the edit loads."""
    save(kind, target, tmp_path)
    load(tmp_path)
    edit_state(tmp_path, lambda s: s["layers.1.mlp.up_proj.weight"].__setitem__((2, 3), value))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.1\.mlp\.up_proj\.weight' "
                                         r"has 1 non-finite"):
        load(tmp_path)


def test_reject_unexpected_tensor(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_state(tmp_path, lambda s: s.__setitem__("embed_tokens.weight", torch.zeros(VOCAB, HIDDEN)))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['embed_tokens.weight'\]"):
        load(tmp_path)


def test_reject_shape_mismatch(target, tmp_path):
    save("mla", target, tmp_path)
    edit_state(tmp_path, lambda s: s.__setitem__("layers.0.self_attn.kv_b_proj.weight", torch.zeros(4, 32)))
    with pytest.raises(ValueError, match="shape mismatch for 'layers.0.self_attn.kv_b_proj.weight'"):
        load(tmp_path)


def test_reject_partial_markov_head(target, tmp_path):
    save("gqa", target, tmp_path, markov_rank=4)
    edit_state(tmp_path, lambda s: s.pop("markov_head.w2.weight"))
    with pytest.raises(ValueError, match=r"module 'markov_head' is partially present; "
                                         r"missing \['markov_head.w2.weight'\]"):
        load(tmp_path)


def test_reject_declared_head_absent(target, tmp_path):
    save("gqa", target, tmp_path, markov_rank=4)
    edit_state(tmp_path, lambda s: [s.pop(k) for k in ("markov_head.w1.weight", "markov_head.w2.weight")])
    with pytest.raises(ValueError, match="config declares markov_head but the checkpoint has none"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(markov_rank=0))
    load(tmp_path)                                       # consistent again


def test_retired_confidence_head_key(target, tmp_path):
    # Older checkpoints carry dspark_config.confidence_head: false loads (shipped drafters do),
    # true raises naming the file and key, and its tensors are not silently dropped.
    save("gqa", target, tmp_path)
    assert "confidence_head" not in json.loads((tmp_path / "config.json").read_text())["dspark_config"]
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=False))
    assert not hasattr(load(tmp_path), "confidence_head")
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=True))
    with pytest.raises(ValueError, match=r"config.json: dspark_config: key 'confidence_head' is true"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head="no"))
    with pytest.raises(ValueError, match=r"dspark_config: key 'confidence_head' must be bool"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=False))
    edit_state(tmp_path, lambda s: s.update({"confidence_head.weight": torch.zeros(1, HIDDEN),
                                             "confidence_head.bias": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['confidence_head.bias', 'confidence_head.weight'\]"):
        load(tmp_path)


@pytest.mark.parametrize("edit,tcfg,message", [
    (None, dict(hidden=96), "drafter hidden_size 64 does not match the target's hidden_size 96"),
    (lambda c: c["dspark_config"].update(num_target_hidden=32), {},
     "num_target_hidden 32 does not match the target's hidden_size 64"),
    (None, dict(vocab=256), "drafter vocab_size 128 does not match the target's vocab_size 256"),
    (lambda c: c.update(architectures=["EagleForCausalLM"]), {},
     r"config.json: unknown drafter architectures \['EagleForCausalLM'\]"),
], ids=["hidden-size", "num-target-hidden", "vocab", "architecture"])
def test_reject_mismatched_config(edit, tcfg, message, target, tmp_path):
    save("gqa", target, tmp_path)
    if edit is not None:
        edit_config(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load(tmp_path, target_config(**tcfg))


def test_reject_missing_dspark_config_key(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].pop("block_size"))
    with pytest.raises(ValueError, match="config.json: dspark_config: missing required key 'block_size'"):
        load(tmp_path)


def test_reject_bad_config_values(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c.update(hidden_size="64"))
    with pytest.raises(ValueError, match="key 'hidden_size' must be int"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c.update(hidden_size=64, dspark_config={**c["dspark_config"], "markov": 2}))
    with pytest.raises(ValueError, match=r"dspark_config: unknown keys \['markov'\]"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: (c["dspark_config"].pop("markov"), c.update(layer_types=["full_attention"])))
    with pytest.raises(ValueError, match="'layer_types' must list 2 entries"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: (c.pop("layer_types"), c["dspark_config"].update(target_layer_ids=[0, 9])))
    with pytest.raises(ValueError, match=r"name layers \[9\] but the target has 4 layers"):
        load(tmp_path)


def test_load_overrides(target, tmp_path):
    save("gqa", target, tmp_path)
    d = load(tmp_path, mask_token_id=5, target_layer_ids=None)
    assert d.config.mask_token_id == 5
    with pytest.raises(ValueError, match="unknown drafter overrides"):
        load(tmp_path, block_sise=3)
