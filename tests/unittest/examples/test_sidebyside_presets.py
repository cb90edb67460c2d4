"""examples/gpu/sidebyside.py: the preset arms become valid `tensorrt_llm.bench.sidebyside` arms
(TorchLlmArgs accepts each), and unknown names or a bad --extra-yaml are refused."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tensorrt_llm.bench import benchmark, sidebyside

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("gpu_sidebyside", REPO / "examples" / "gpu" / "sidebyside.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def test_presets_parse_and_validate(tiny_llama_dir, tmp_path):
    specs = ex.arm_specs(["hf", "nospec", "gqa", "mla"], "/d/gqa", "/d/mla", "FLASHINFER", True, 262144,
                         "batch_wait_timeout_iters: 8")
    arms = [sidebyside.parse_arm(s) for s in specs]
    assert [a.name for a in arms] == ["hf", "nospec", "gqa", "mla"] and arms[0].is_hf
    assert arms[1].llm_args == {"attn_backend": "FLASHINFER", "use_cuda_graph": True,
                                "kv_cache_config": {"max_tokens": 262144}, "batch_wait_timeout_iters": 8}
    assert arms[2].llm_args["speculative_config"] == {"decoding_type": "DSpark", "speculative_model": "/d/gqa"}
    assert arms[3].llm_args["speculative_config"]["speculative_model"] == "/d/mla"
    y = tmp_path / "a.yaml"
    y.write_text(specs[1].split("=", 1)[1])
    args = benchmark.build_llm_args(str(tiny_llama_dir), str(y), [1, 16, 64])   # pydantic accepts it
    assert args.attn_backend == "FLASHINFER" and args.max_batch_size == 64
    # DSpark arms on another target backend (overlapped DSpark steps), no-spec unchanged
    tri = [sidebyside.parse_arm(s) for s in ex.arm_specs(["nospec", "gqa"], "/g", "/m", "FLASHINFER", True, 1024,
                                                          None, "TRITON")]
    assert tri[0].llm_args["attn_backend"] == "FLASHINFER" and tri[1].llm_args["attn_backend"] == "TRITON"
    sched = [sidebyside.parse_arm(s) for s in ex.arm_specs(["gqa"], "/g", "/m", "FLASHINFER", True, 1024, None,
                                                            None, "{draft_len_schedule: {4: 8, 64: 2}}")]
    assert sched[0].llm_args["speculative_config"]["draft_len_schedule"] == {4: 8, 64: 2}
    with pytest.raises(ValueError, match="spec-extra-yaml"):
        ex.arm_specs(["gqa"], "/g", "/m", "VANILLA", False, 1024, None, None, "[1]")
    with pytest.raises(ValueError):
        ex.arm_specs(["nospec", "eagle"], "", "", "VANILLA", False, 1024, None)
    with pytest.raises(ValueError):
        ex.arm_specs(["nospec"], "", "", "VANILLA", False, 1024, "[1, 2]")


def test_variants_copy_a_preset_with_merged_args():
    specs = ex.arm_specs(["nospec", "gqa"], "/g", "/m", "TRITON", True, 1024, None, None, None,
                         ["gqa_s8=gqa:{batch_admit_min_slots: 8, speculative_config: {draft_len_schedule: {64: 4}}}",
                          "nospec_s8=nospec:{batch_admit_min_slots: 8}"])
    arms = [sidebyside.parse_arm(s) for s in specs]
    assert [a.name for a in arms] == ["nospec", "gqa", "gqa_s8", "nospec_s8"]
    assert arms[2].llm_args["batch_admit_min_slots"] == 8 and "batch_admit_min_slots" not in arms[1].llm_args
    assert arms[2].llm_args["speculative_config"] == {"decoding_type": "DSpark", "speculative_model": "/g",
                                                      "draft_len_schedule": {64: 4}}
    assert arms[3].llm_args == {**arms[0].llm_args, "batch_admit_min_slots": 8}
    for bad in ("gqa_s8=gqa", "x=hf:{a: 1}", "gqa=gqa:{a: 1}", "y=eagle:{a: 1}", "z=gqa:[1]"):
        with pytest.raises(ValueError):
            ex.arm_specs(["gqa"], "/g", "/m", "TRITON", True, 1024, None, None, None, [bad])
    with pytest.raises(ValueError, match="new NAME"):       # a name taken by an earlier variant
        ex.arm_specs(["gqa"], "/g", "/m", "TRITON", True, 1024, None, None, None, ["v=gqa:{a: 1}", "v=gqa:{a: 2}"])


def test_build_argv_defaults(tmp_path):
    a = ex.argparse.Namespace(arms="nospec,gqa", model="/model", gqa="/g", mla="/m",
                              prompts_file=str(tmp_path / "none.json"), dataset_cache_dir=None, concurrency=[1, 16],
                              rounds=3, max_tokens=256, waves=2, min_requests=16, backend="FLASHINFER", graphs=True,
                              kv_tokens=262144, extra_yaml=None, anchor=True, anchor_timeout_s=240, out=str(tmp_path),
                              deadline_s=540, spec_backend=None, spec_extra_yaml=None, variant=[],
                              request_timeout_s=120.0)
    argv = ex.build_argv(a)
    assert argv[argv.index("--concurrency") + 1:argv.index("--rounds")] == ["1", "16"]
    assert argv.count("--arm") == 2 and "--ratio-to" in argv and argv[argv.index("--ratio-to") + 1] == "nospec"
    assert "--dataset" in argv and "--prompts-file" not in argv          # the file does not exist
    assert argv[argv.index("--anchor") + 1].endswith("examples/gpu/compiled_step_anchor.py")
    assert argv[argv.index("--anchor-timeout-s") + 1] == "240"
    assert argv[argv.index("--deadline-s") + 1] == "540"
    assert argv[argv.index("--request-timeout-s") + 1] == "120.0"


def test_docs_mla_folds_variant_is_a_valid_dspark_arm():
    """docs/dspark.md's A/B arm of both MLA folds, word for word: the MLA preset with both folds set, a
    config DSparkDecodingConfig accepts. Control: a misspelled fold is refused (strict config)."""
    from tensorrt_llm.llmapi.llm_args import DSparkDecodingConfig
    variant = "mla_foldq=mla:{speculative_config: {mla_fold_query: true, mla_fold_output: true}}"
    assert f"'{variant}'" in (REPO / "docs" / "dspark.md").read_text()
    arm = sidebyside.parse_arm(ex.arm_specs(["mla"], "/g", "/m", "TRITON", True, 1024, None, None, None,
                                            [variant])[-1])
    cfg = DSparkDecodingConfig(**arm.llm_args["speculative_config"])
    assert arm.name == "mla_foldq" and cfg.mla_fold_query and cfg.mla_fold_output and cfg.speculative_model == "/m"
    with pytest.raises(ValueError, match="mla_fold_querry"):
        DSparkDecodingConfig(speculative_model="/m", mla_fold_querry=True)
