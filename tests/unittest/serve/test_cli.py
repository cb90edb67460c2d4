"""`trtllm-serve` arguments: the YAML is TorchLlmArgs (MODEL overrides its `model`), errors exit cleanly."""
from __future__ import annotations

import pytest

from tensorrt_llm.serve import cli


def test_config_aliases_and_model_override(tmp_path):
    y = tmp_path / "serve.yaml"
    y.write_text("model: /elsewhere\ndevice: cpu\nmax_batch_size: 3\n"
                 "speculative_config: {decoding_type: DSpark, speculative_model: /d}\n")
    for flag in ("--config", "--extra_llm_api_options", "--extra-llm-api-options"):
        a = cli.make_parser().parse_args(["/m", flag, str(y)])
        args = cli.build_args(a.model, a.config)
        assert args.model == "/m" and args.max_batch_size == 3
        assert args.speculative_config.speculative_model == "/d"
    assert cli.build_args("/m", None).model == "/m"


def test_bad_yaml_exits_naming_the_file(tmp_path, capsys):
    y = tmp_path / "bad.yaml"
    y.write_text("device: cpu\nmax_batch_sise: 3\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["/m", "--config", str(y)])
    assert e.value.code == 2 and "bad.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["/m", "--port", "70000"])
