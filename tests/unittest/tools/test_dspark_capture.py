"""Dense (right-padded, causal SDPA) target capture == the engine's paged VANILLA capture."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm.tools.dspark_capture import TargetCapture

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                      tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    model.fuse_projections()
    return model


def _seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def test_dense_equals_paged(target):
    seqs = _seqs([17, 5, 33, 40])
    dense, ids_d, lens_d = TargetCapture(target, LAYERS, "dense")(seqs)
    paged, ids_p, lens_p = TargetCapture(target, LAYERS, "paged")(seqs)
    assert dense.shape == (4, 40, 2 * 64)
    assert torch.equal(ids_d, ids_p) and torch.equal(lens_d, lens_p)
    err = (dense - paged).abs().max() / paged.abs().max()
    assert err < 1e-5
    for i, q in enumerate(seqs[:-1]):                               # padding rows are zero
        assert dense[i, len(q):].abs().max() == 0
    # negative control: the wrong layer lands far outside the tolerance
    other, _, _ = TargetCapture(target, [1, 3], "dense")(seqs)
    assert (other - paged).abs().max() / paged.abs().max() > 0.1


def test_dense_is_causal_and_batch_independent(target):
    """A token changed at position p moves rows >= p only; a neighbour's length changes nothing."""
    seqs = _seqs([30, 12])
    base, _, _ = TargetCapture(target, LAYERS)(seqs)
    edited = [list(seqs[0]), seqs[1]]
    edited[0][20] = (edited[0][20] + 7) % 128
    moved, _, _ = TargetCapture(target, LAYERS)(edited)
    assert torch.allclose(moved[0, :20], base[0, :20], atol=1e-6)
    assert (moved[0, 20:] - base[0, 20:]).abs().max() > 1e-2
    alone, _, _ = TargetCapture(target, LAYERS)([seqs[1]])
    assert torch.allclose(alone[0], base[1, :12], atol=1e-5)


def test_capture_rejects_bad_input(target):
    with pytest.raises(ValueError, match="layer ids"):
        TargetCapture(target, [0, 9])
    with pytest.raises(ValueError, match="capture mode"):
        TargetCapture(target, [0], "flash")
    with pytest.raises(ValueError, match="non-empty"):
        TargetCapture(target, [0])([[1, 2], []])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_equals_paged_cuda_bf16(target):
    """On CUDA in bf16 the dense path runs flash attention; it must still match the paged reference."""
    model = LlamaForCausalLM(target.config).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(target.state_dict())
    model.fuse_projections()
    seqs = _seqs([200, 77, 256, 9], seed=3)
    dense, _, _ = TargetCapture(model, LAYERS, "dense")(seqs)
    paged, _, _ = TargetCapture(model, LAYERS, "paged")(seqs)
    ref, _, _ = TargetCapture(target, LAYERS, "paged")(seqs)                    # fp32 CPU
    ref = ref.to("cuda")
    err_dense = float((dense.float() - ref).norm() / ref.norm())
    err_paged = float((paged.float() - ref).norm() / ref.norm())
    assert err_dense < 2e-2 and err_dense < 2 * err_paged + 1e-3, (err_dense, err_paged)
    shifted = float((dense[:, 1:].float() - ref[:, :-1]).norm() / ref.norm())     # negative control
    assert shifted > 0.3, shifted
    # The final-normed states (distillation teacher) match too, with the same negative control.
    _, fin, _, _ = TargetCapture(model, LAYERS, "dense").with_final(seqs)
    _, fin_ref, _, _ = TargetCapture(target, LAYERS, "paged").with_final(seqs)
    fin_ref = fin_ref.to("cuda")
    err_fin = float((fin.float() - fin_ref).norm() / fin_ref.norm())
    assert err_fin < 3e-2, err_fin
    assert float((fin[:, 1:].float() - fin_ref[:, :-1]).norm() / fin_ref.norm()) > 0.3
