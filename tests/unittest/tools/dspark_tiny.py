"""The tiny target (transformers Llama + BPE tokenizer + chat template) and drafter config shared by
the drafter-training tests (test_train_dspark.py, test_dspark_data.py); the fixture is in conftest.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tensorrt_llm.tools.dspark_train_config import DSparkTrainConfig

VOCAB, SPECIALS = 512, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]
MASK_ID = 3
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
PROMPTS = ["the quick brown fox", "hello world, what is the capital of france?", "once upon a time",
           "a paged kv cache holds keys and values", "speculative decoding drafts tokens", "tell me a story",
           "what is two plus two?", "write a poem about the sea", "why is the sky blue?", "name three colors",
           "count from one to ten", "describe a cat"]


def build_tiny_target(folder: Path) -> Path:
    """transformers Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512) + BPE tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                      # peaky logits: greedy text is stable and learnable
        for name, p in model.named_parameters():
            if "norm" not in name:
                scale = 0.5 if "embed" in name else 2.0 * p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(folder, safe_serialization=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    (folder / "prompts.json").write_text(json.dumps(PROMPTS))
    return folder


TINY_DRAFTER = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "block_size": 4,
                "target_layer_ids": [0, 1], "mask_token_id": MASK_ID, "markov_rank": 4,
                "gqa": {"num_key_value_heads": 2, "head_dim": 16},
                "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}}


def tiny_config(target: Path, out: Path, backbone: str, **train) -> DSparkTrainConfig:
    return DSparkTrainConfig(
        target=str(target), backbone=backbone, output_dir=str(out),
        drafter=TINY_DRAFTER,
        data={"prompts_file": str(target / "prompts.json"), "num_prompts": 12, "max_prompt_tokens": 64,
              "max_new_tokens": 24, "gen_batch": 8, "cache_file": str(out.parent / "regen.jsonl")},
        train={"steps": 30, "batch_size": 4, "anchors_per_seq": 6, "lr": 3e-3, "warmup_steps": 3,
               "eval_fraction": 0.25, "eval_every": 10, "checkpoint_every": 10, "device": "cpu", **train})
