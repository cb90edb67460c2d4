"""trtllm-train-dspark: block mask / labels reference, training forward == paged engine path,
and short end-to-end runs (regenerate with `LLM`, train, checkpoint, resume, load) on a tiny target.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.dspark_loader import load_drafter
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.speculative.dspark_worker import draft_kv_cache_spec
from tensorrt_llm.tools.dspark_data import regenerate
from tensorrt_llm.tools.dspark_train_config import DSparkTrainConfig
from tensorrt_llm.tools.dspark_train_forward import (IGNORE_INDEX, block_inputs, block_labels, block_logits,
                                                     build_block_mask, expected_accept_length, train_forward)
from tensorrt_llm.tools.train_dspark import main, train
from dspark_tiny import MASK_ID, TINY_DRAFTER, VOCAB, tiny_config

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- mask and labels reference -------------------------------------------------------------
def loop_mask(anchors: list[list[int]], ctx_len: int, block: int) -> torch.Tensor:
    """The DSpark visibility rule written element by element (independent of build_block_mask)."""
    s, a = len(anchors), len(anchors[0])
    out = torch.zeros(s, a * block, ctx_len + a * block, dtype=torch.bool)
    for b in range(s):
        for i, anchor in enumerate(anchors[b]):
            for j in range(block):
                for p in range(ctx_len):
                    out[b, i * block + j, p] = p < anchor          # the anchor itself is block token 0
                for k in range(a * block):
                    out[b, i * block + j, ctx_len + k] = k // block == i
    return out


def test_block_mask_matches_rule_and_catches_leaks():
    anchors = [[3, 7, 11], [1, 5, 8]]
    ref = loop_mask(anchors, 12, 4)
    assert torch.equal(build_block_mask(torch.tensor(anchors), 12, 4), ref)
    # Negative controls: context visible at position == anchor; blocks seeing each other.
    leak = build_block_mask(torch.tensor(anchors) + 1, 12, 4)
    assert not torch.equal(leak, ref) and bool((leak & ~ref).any())
    cross = build_block_mask(torch.tensor(anchors), 12, 4)
    cross[:, :, 12:] = True
    assert not torch.equal(cross, ref)
    # Sliding window: a key is hidden once it is `window` or more positions behind the query.
    win = build_block_mask(torch.tensor([[6]]), 8, 2, sliding_window=3)
    assert win[0, 0, :8].nonzero().flatten().tolist() == [4, 5]      # query at 6 sees 4, 5
    assert win[0, 1, :8].nonzero().flatten().tolist() == [5]         # query at 7 sees 5 (and its block)


def test_block_labels_shift_and_markov_prev():
    ids = (1000 + torch.arange(20)).expand(2, 20).clone()            # token == 1000 + position
    anchors = torch.tensor([[4, 15, 0], [2, 9, 17]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    lens = torch.tensor([20, 19])
    labels, prev = block_labels(ids, anchors, valid, lens, 4)
    for b in range(2):
        for i in range(3):
            a = int(anchors[b, i])
            for j in range(4):
                want = 1000 + a + 1 + j if bool(valid[b, i]) and a + 1 + j < int(lens[b]) else IGNORE_INDEX
                assert int(labels[b, i, j]) == want, (b, i, j)
                if want != IGNORE_INDEX:
                    assert int(prev[b, i, j]) == want - 1             # teacher-forced previous token
    # Negative control: without the shift, slot j would be labelled with t[a+j] (and slot 0 unused).
    unshifted, _ = block_labels(ids, anchors, valid, lens, 4, shift_label=False)
    assert not torch.equal(unshifted, labels)
    assert int(unshifted[0, 0, 1]) == 1000 + 4 + 1 and int(unshifted[0, 0, 0]) == IGNORE_INDEX
    block_ids, pos = block_inputs(ids, anchors, 4, MASK_ID)
    assert block_ids[1, 1].tolist() == [1009, MASK_ID, MASK_ID, MASK_ID]
    assert pos[1, 1].tolist() == [9, 10, 11, 12]


def test_expected_accept_length():
    labels = torch.tensor([[[5, 6, 7, 8], [1, 2, IGNORE_INDEX, IGNORE_INDEX]]])
    pred = torch.tensor([[[5, 6, 0, 8], [1, 2, 3, 4]]])
    al, n = expected_accept_length(pred, labels, torch.tensor([[True, True]]))
    assert n == 2 and al == pytest.approx((1 + 2 + 1 + 2) / 2)    # stops at the first miss / ignored slot
    shifted = torch.roll(labels, 1, dims=-1)
    assert expected_accept_length(pred, shifted, torch.tensor([[True, True]]))[0] < al


# ---- training forward == engine paged path -------------------------------------------------
TINY = LlamaConfig("LlamaForCausalLM", VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                   rope_theta=1000.0, rope_scaling=None, max_position_embeddings=512,
                   tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)


def paged_blocks(drafter, feats: torch.Tensor, ids: torch.Tensor, anchors: list[int], g: torch.Generator,
                 page: int = 4) -> torch.Tensor:
    """The engine's path: per anchor a request with context 0..a-1 in random pages + one block.

    feats [L, H] context features of one sequence, ids [L]. Returns hidden [R, B, H].
    """
    b, r = drafter.config.block_size, len(anchors)
    need = [math.ceil((a + b) / page) for a in anchors]
    num_pages = sum(need) + 3
    free = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((r, max(need)), BAD_PAGE_INDEX, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)

    def slots(i: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return table[i, pos // page].long() * page + pos % page

    spec = draft_kv_cache_spec(drafter, torch.float32)
    caches = [torch.zeros(spec.layer_shape(num_pages, page)) for _ in range(spec.num_layers)]
    backend = VanillaAttention()
    for i, a in enumerate(anchors):
        drafter.write_context(feats[:a], torch.arange(a), slots(i, 0, a), caches, backend)
    md = AttentionMetadata(seq_lens=[b] * r, num_cached=list(anchors), block_tables=table,
                           slot_mapping=torch.cat([slots(i, a, a + b) for i, a in enumerate(anchors)]),
                           tokens_per_block=page, causal=False)
    md.validate(num_pages)
    backend.prepare(md)
    mask = drafter.config.mask_token_id
    block_ids = torch.cat([torch.tensor([int(ids[a])] + [mask] * (b - 1)) for a in anchors])
    positions = torch.cat([torch.arange(a, a + b) for a in anchors])
    return drafter.forward_block(block_ids, positions, md, caches, backend).view(r, b, -1)


@pytest.mark.parametrize("kind,window", [("gqa", None), ("gqa", 6), ("mla", None)])
@torch.no_grad()
def test_train_forward_matches_paged_inference(kind, window, monkeypatch):
    import tensorrt_llm.tools.dspark_train_forward as tf
    g = torch.Generator().manual_seed(7)
    extra = {"sliding_window": window} if window else {}
    drafter = DSparkForCausalLMBase.random_init(kind, TINY, seed=3, markov_rank=8, block_size=4, **extra)
    embed, lm_head = torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB, bias=False)
    embed.weight.copy_(torch.randn(VOCAB, 64, generator=g))
    lm_head.weight.copy_(torch.randn(VOCAB, 64, generator=g) * 0.3)
    for p in drafter.markov_head.parameters():                 # a Markov bias as large as the logits
        p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    drafter.bind_target(embed, lm_head)
    length = 40
    captured = torch.randn(2, length, drafter.config.fc_in_features, generator=g)
    ids = torch.randint(0, VOCAB - 1, (2, length), generator=g)
    anchors = torch.stack([torch.randperm(length - 2, generator=g)[:5].sort().values + 1 for _ in range(2)])
    feats = drafter.context_features(captured)
    block_ids, _ = block_inputs(ids, anchors, 4, drafter.config.mask_token_id)
    hidden = train_forward(drafter, feats, block_ids, anchors)                       # [2, 5, 4, H]
    labels, prev = block_labels(ids, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                torch.tensor([length] * 2), 4)
    for s in range(2):
        ref = paged_blocks(drafter, feats[s], ids[s], anchors[s].tolist(), g)
        assert rel_err(hidden[s], ref) < 1e-4
        # Logits + teacher-forced Markov head == the engine's `propose` fed the true tokens.
        forced = iter(labels[s].clamp(min=0).unbind(1))
        _, eng_logits = drafter.propose(ref.reshape(-1, ref.shape[-1]), ids[s, anchors[s]], 4,
                                        pick=lambda _logits: next(forced))
        mine = block_logits(drafter, hidden[s].reshape(-1, 64), prev[s].reshape(-1)).view(5, 4, -1)
        ok = labels[s] != IGNORE_INDEX
        assert rel_err(mine[ok], eng_logits[ok]) < 1e-4
        # Negative control: the Markov input shifted by one (the label itself) must differ.
        shifted_prev = labels[s].clamp(min=0).reshape(-1)
        wrong = block_logits(drafter, hidden[s].reshape(-1, 64), shifted_prev).view(5, 4, -1)
        assert rel_err(wrong[ok], eng_logits[ok]) > 1e-3
    # Negative control: letting a block see the context entry at position == anchor changes the output.
    leaky = tf.build_block_mask
    monkeypatch.setattr(tf, "build_block_mask", lambda anc, *a, **k: leaky(anc + 1, *a, **k))
    bad = tf.train_forward(drafter, feats, block_ids, anchors)
    assert rel_err(bad[0], paged_blocks(drafter, feats[0], ids[0], anchors[0].tolist(), g)) > 1e-3


# ---- end to end on the tiny target ---------------------------------------------------------
@pytest.mark.parametrize("backbone", ["gqa", "mla"])
def test_train_end_to_end_loss_checkpoint_and_engine_load(tiny_target, tmp_path, backbone):
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm._torch.models import load_target_model
    cfg = tiny_config(tiny_target, tmp_path / backbone, backbone, steps=16, eval_every=8)
    rows = regenerate(cfg)
    assert len(rows) == 12 and all(len(r["output_ids"]) == 24 for r in rows)
    assert cfg.cache_file.is_file() and cfg.cache_file.with_suffix(".meta.json").is_file()
    log = train(cfg, rows)
    losses = [h["loss"] for h in log["history"]]
    assert log["steps"] == 16 and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert log["train_time_al"] >= 1.0 and log["eval_anchors"] > 0
    saved = json.loads((tmp_path / backbone / "training_log.json").read_text())
    assert saved["config"]["backbone"] == backbone and saved["final_loss"] == pytest.approx(log["final_loss"])
    assert (tmp_path / backbone / "checkpoint" / "state.pt").is_file()
    # The drafter folder loads strictly in the engine and serves speculative decoding.
    target = load_target_model(tiny_target, torch.float32, torch.device("cpu"))
    drafter = load_drafter(tmp_path / backbone / "drafter", target.config, torch.float32, torch.device("cpu"))
    assert drafter.config.block_size == 4 and drafter.config.markov_rank == 4
    spec = {"decoding_type": "DSpark", "speculative_model": str(tmp_path / backbone / "drafter")}
    llm = LLM(str(tiny_target), device="cpu", kv_cache_config={"max_tokens": 1024, "tokens_per_block": 16},
              speculative_config=spec)
    try:
        out = llm.generate(rows[0]["prompt_ids"], SamplingParams(max_tokens=12))
        assert out.outputs[0].token_ids == rows[0]["output_ids"][:12]     # lossless: greedy == regenerated
    finally:
        llm.shutdown()
    # A rerun reuses the cache instead of regenerating.
    assert regenerate(cfg) == rows


def test_init_from_a_saved_drafter(tiny_target, tmp_path):
    """train.init_from starts from a saved drafter's weights (its first loss is the trained level,
    far below a random init's), and a drafter of another shape is refused by name."""
    first = tiny_config(tiny_target, tmp_path / "a", "mla", steps=30, eval_every=30)
    rows = regenerate(first)
    trained = train(first, rows)
    fresh = train(tiny_config(tiny_target, tmp_path / "b", "mla", steps=1, eval_every=1), rows)
    cont_cfg = tiny_config(tiny_target, tmp_path / "c", "mla", steps=1, eval_every=1,
                           init_from=str(tmp_path / "a" / "drafter"))
    cont = train(cont_cfg, rows)
    start = cont["history"][0]["loss"]
    assert start < 0.5 * fresh["history"][0]["loss"]                      # negative control: random init
    assert start < 1.5 * trained["final_loss"]
    assert cont["eval_loss"] < 0.8 * fresh["eval_loss"]
    other = tiny_config(tiny_target, tmp_path / "d", "gqa", steps=1, init_from=str(tmp_path / "a" / "drafter"))
    with pytest.raises(ValueError, match="init_from .* differs"):
        train(other, rows)


def test_resume_continues_from_saved_step(tiny_target, tmp_path):
    whole = tiny_config(tiny_target, tmp_path / "whole", "gqa", steps=8, checkpoint_every=4, eval_every=4)
    rows = regenerate(whole)
    ref = train(whole, rows)

    class Crash(Exception):
        pass

    def crash_at_5(step: int, loss: float) -> None:
        if step == 5:
            raise Crash

    split = tiny_config(tiny_target, tmp_path / "split", "gqa", steps=8, checkpoint_every=4, eval_every=4)
    with pytest.raises(Crash):
        train(split, rows, on_step=crash_at_5)
    log = train(split, rows)                                    # resumes from the step-4 checkpoint
    assert [h["step"] for h in log["history"]] == list(range(1, 9))
    assert [h["loss"] for h in log["history"]] == pytest.approx([h["loss"] for h in ref["history"]], rel=1e-5)
    a = torch.load(tmp_path / "whole" / "checkpoint" / "state.pt", weights_only=False)["drafter"]
    b = torch.load(tmp_path / "split" / "checkpoint" / "state.pt", weights_only=False)["drafter"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    again = train(split, rows)                                  # a finished run only re-evaluates and exports
    assert again["steps"] == 8 and len(again["history"]) == 8 and again["train_time_al"] is not None


def test_cli_yaml_overrides_and_stages(tiny_target, tmp_path):
    import yaml
    cfg = tiny_config(tiny_target, tmp_path / "cli", "mla", steps=3)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(exclude_none=True)))
    with pytest.raises(SystemExit):                             # --stage train needs a finished cache
        main(["--config", str(path), "--stage", "train"])
    assert main(["--config", str(path), "--stage", "data"]) == 0
    assert main(["--config", str(path), "--stage", "train", "--steps", "2",
                 "--set", "train.eval_every=1"]) == 0
    log = json.loads((tmp_path / "cli" / "training_log.json").read_text())
    assert log["steps"] == 2 and log["config"]["train"]["eval_every"] == 1
    with pytest.raises(ValueError, match="extra|not permitted"):
        DSparkTrainConfig.from_yaml(path, {"train.stepz": 3})
    with pytest.raises(ValueError, match="other settings"):   # a finished cache never silently mismatches
        regenerate(DSparkTrainConfig.from_yaml(path, {"data.max_new_tokens": 8}))


def test_shipped_configs_fit_budget():
    """examples/dspark/train_{gqa,mla}.yaml differ only in backbone; each drafter <= 45 MB in bf16."""
    from tensorrt_llm.tools.train_dspark import build_drafter
    root = Path(__file__).resolve().parents[3] / "examples" / "dspark"
    smol = dataclasses.replace(TINY, vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                               max_position_embeddings=8192)          # SmolLM2-135M's shapes
    cfgs = {b: DSparkTrainConfig.from_yaml(root / f"train_{b}.yaml") for b in ("gqa", "mla")}
    g, m = (c.model_dump() for c in cfgs.values())
    for d in (g, m):
        d.pop("backbone"), d.pop("output_dir"), d["drafter"].pop("gqa"), d["drafter"].pop("mla")
    assert g == m
    expected = {"gqa": 18_353_536, "mla": 22_308_096}
    for backbone, cfg in cfgs.items():
        with torch.device("meta"):
            n = sum(p.numel() for p in build_drafter(cfg, smol).parameters())
        assert n == expected[backbone] and 2 * n <= 45e6


# ---- the two-GPU driver script, on CPU -----------------------------------------------------
def as_set_flags(tree: dict, prefix: str) -> list[str]:
    """{"a": {"b": 1}} -> ["--set", "<prefix>a.b=1"] (values as YAML/JSON)."""
    out = []
    for k, v in tree.items():
        out += as_set_flags(v, f"{prefix}{k}.") if isinstance(v, dict) else ["--set", f"{prefix}{k}={json.dumps(v)}"]
    return out


TINY_SETS = as_set_flags(TINY_DRAFTER, "drafter.") + as_set_flags(
    {"data": {"max_prompt_tokens": 64, "max_new_tokens": 12, "gen_batch": 4},
     "train": {"device": "cpu", "batch_size": 2, "anchors_per_seq": 4, "warmup_steps": 1, "eval_every": 1000}}, "")


def test_train_on_h200_script_rounds_on_cpu(tiny_target, tmp_path):
    """examples/dspark/train_on_h200.sh: a probed first round, then a round that continues from it
    (--init-from <earlier --out>) on fresh prompts (--skip-prompts) with a fixed step count and
    twice the regeneration processes (--procs-per-gpu 2: four shards)."""
    import subprocess
    import sys

    from tensorrt_llm._torch.models import load_target_model
    script = Path(__file__).resolve().parents[3] / "examples" / "dspark" / "train_on_h200.sh"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": "", "HOME": str(tmp_path)}

    def run(out: str, *args: str) -> None:
        cmd = ["bash", str(script), "--model", str(tiny_target), "--prompts", str(tiny_target / "prompts.json"),
               "--out", str(tmp_path / out), "--num-prompts", "6", "--max-new-tokens", "12", *args,
               "--", *TINY_SETS]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    bad = subprocess.run(["bash", str(script), "--model", str(tiny_target), "--prompts",
                          str(tiny_target / "prompts.json"), "--out", str(tmp_path / "bad"), "--procs-per-gpu", "0"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--procs-per-gpu must be a positive integer, got 0" in bad.stderr
    run("r0", "--minutes", "0.001", "--min-steps", "3")
    assert int((tmp_path / "r0" / "steps.txt").read_text()) == 3          # probe -> the floor
    run("r1", "--steps", "2", "--skip-prompts", "6", "--init-from", str(tmp_path / "r0"), "--procs-per-gpu", "2")
    assert not (tmp_path / "r1" / "probe" / "gqa" / "training_log.json").exists()
    assert len(list((tmp_path / "r0" / "data").glob("regen.shard*.meta.json"))) == 2
    assert len(list((tmp_path / "r1" / "data").glob("regen.shard*.meta.json"))) == 4      # 2 per "GPU"
    prompts = {}
    for r in ("r0", "r1"):
        rows = [json.loads(line) for f in sorted((tmp_path / r / "data").glob("regen.shard*.jsonl"))
                for line in f.read_text().splitlines()]
        prompts[r] = {tuple(x["prompt_ids"]) for x in rows}
        assert len(prompts[r]) == 6
    assert not prompts["r0"] & prompts["r1"]                               # fresh prompts
    target_config = load_target_model(tiny_target, torch.float32, torch.device("cpu")).config
    for b in ("gqa", "mla"):
        log = json.loads((tmp_path / "r1" / b / "training_log.json").read_text())
        assert log["steps"] == 2
        assert log["config"]["train"]["init_from"] == str(tmp_path / "r0" / b / "drafter")
        assert log["config"]["data"]["skip_prompts"] == 6
        load_drafter(tmp_path / "r1" / b / "drafter", target_config, torch.float32, torch.device("cpu"))


# ---- distillation on the target's distribution (train.kd_weight) ---------------------------
def test_teacher_positions_predict_the_greedy_labels(tiny_target, tmp_path):
    """The target's final hidden state at `teacher_positions` predicts each slot's label: on greedy
    data its argmax IS the label. Shifting the positions by one (an off-by-one) breaks that."""
    from tensorrt_llm._torch.models import load_target_model
    from tensorrt_llm.tools.dspark_capture import TargetCapture
    from tensorrt_llm.tools.dspark_train_forward import sample_anchors, teacher_positions
    from tensorrt_llm.tools.train_dspark import make_batch
    rows = regenerate(tiny_config(tiny_target, tmp_path / "kd", "gqa"))
    target = load_target_model(tiny_target, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["output_ids"]), 6, g) for r in rows]
    capture = TargetCapture(target, [0, 1], "dense")
    _, ids, lens, anc, valid, final = make_batch(rows, capture, anchors, final=True)
    labels, _ = block_labels(ids, anc, valid, lens, 4)
    ok = labels != IGNORE_INDEX

    def argmax_at(shift: int) -> torch.Tensor:
        pos = (teacher_positions(anc, 4) + shift).clamp(0, ids.shape[1] - 1)
        h = final.gather(1, pos.reshape(len(rows), -1, 1).expand(-1, -1, final.shape[-1]))
        return target.lm_head(h).argmax(-1).view(labels.shape)

    assert bool(ok.any()) and bool((argmax_at(0)[ok] == labels[ok]).all())
    assert float((argmax_at(1)[ok] == labels[ok]).float().mean()) < 0.5          # off by one
    assert float((argmax_at(-1)[ok] == labels[ok]).float().mean()) < 0.5
    # The paged reference gives the same final states; __call__ still returns 3 values.
    seqs = [r["prompt_ids"] + r["output_ids"] for r in rows]
    _, fin_p, _, _ = TargetCapture(target, [0, 1], "paged").with_final(seqs)
    assert rel_err(fin_p, final) < 1e-5 and len(capture([rows[0]["prompt_ids"]])) == 3


def test_block_loss_distillation_terms():
    """kd_weight 0 is the plain CE loss; the KL term equals an independent F.kl_div, is ~0 when the
    teacher's distribution is the drafter's own, and is far from 0 for another teacher."""
    import torch.nn.functional as F

    from tensorrt_llm.tools.dspark_train_forward import block_loss
    torch.manual_seed(0)
    drafter = DSparkForCausalLMBase.random_init(
        "gqa", TINY, seed=0, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, block_size=4,
        target_layer_ids=[0, 1], mask_token_id=MASK_ID, markov_rank=0, num_key_value_heads=2, head_dim=16)
    emb = torch.nn.Embedding(VOCAB, 64)
    head = torch.nn.Linear(64, VOCAB, bias=False)
    head.weight.data.normal_(0, 0.5)
    drafter.bind_target(emb, head)
    hidden = torch.randn(2, 3, 4, 64)
    labels = torch.randint(0, VOCAB, (2, 3, 4))
    labels[1, 2] = IGNORE_INDEX
    prev = torch.randint(0, VOCAB, (2, 3, 4))
    plain, _ = block_loss(drafter, hidden, labels, prev, 4.0)
    same, st0 = block_loss(drafter, hidden, labels, prev, 4.0, hidden, kd_weight=0.0)
    assert torch.equal(plain, same) and "kl" not in st0
    _, st = block_loss(drafter, hidden, labels, prev, 4.0, hidden.clone(), kd_weight=1.0)
    assert float(st["kl"]) == pytest.approx(0.0, abs=1e-5)
    other = torch.randn(2, 3, 4, 64)
    loss, st = block_loss(drafter, hidden, labels, prev, 4.0, other, kd_weight=1.0)
    ok = labels != IGNORE_INDEX
    with torch.no_grad():
        ref = F.kl_div(F.log_softmax(head(hidden[ok]), -1), F.log_softmax(head(other[ok]), -1),
                       log_target=True, reduction="none").sum(-1)
    assert float(st["kl"]) == pytest.approx(float(ref.mean()), rel=1e-4) and float(st["kl"]) > 1.0
    w = torch.exp(-torch.arange(4.0) / 4.0).expand(2, 3, 4)[ok]
    assert float(loss.detach()) == pytest.approx(float((w * ref).sum() / w.sum()), rel=1e-4)
    with pytest.raises(ValueError, match="teacher_hidden"):
        block_loss(drafter, hidden, labels, prev, 4.0, None, kd_weight=0.5)


def test_train_with_distillation(tiny_target, tmp_path):
    """kd_weight 0.5 trains (loss and KL fall); held-out loss stays pure CE, comparable to a CE run."""
    cfg = tiny_config(tiny_target, tmp_path / "kd", "mla", steps=16, eval_every=8, kd_weight=0.5)
    rows = regenerate(cfg)
    log = train(cfg, rows)
    h = log["history"]
    assert all("kl" in r for r in h) and sum(r["kl"] for r in h[-4:]) < 0.7 * sum(r["kl"] for r in h[:4])
    assert sum(r["loss"] for r in h[-4:]) < 0.7 * sum(r["loss"] for r in h[:4])
    ce = train(tiny_config(tiny_target, tmp_path / "ce", "mla", steps=16, eval_every=8), rows)
    assert "kl" not in ce["history"][0]
    assert 0.5 < log["eval_loss"] / ce["eval_loss"] < 2.0          # same metric (CE), similar level
    with pytest.raises(ValueError, match="kd_weight"):
        tiny_config(tiny_target, tmp_path / "bad", "mla", kd_weight=1.5)
