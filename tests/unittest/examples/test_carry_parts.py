"""examples/gpu/carry_parts.py: the stream cut, a pack -> assemble round trip over several "calls"
(one part each, in any order), idempotence, and the negative controls (a corrupt piece, mixed sets).
(Not under tests/unittest/examples/gpu/: pytest would read the folder name as the `gpu` mark.)"""
from __future__ import annotations

import importlib.util
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cp = _load("carry_parts")


def test_plan_parts_stream_cut():
    plan = cp.plan_parts([5, 0, 12, 3], 8)
    assert plan == [[(0, 0, 5)], [(0, 0, 0)], [(0, 0, 3), (1, 3, 8), (2, 11, 1)], [(2, 0, 3)]]
    per_part = {}
    for pieces in plan:
        for part, _, n in pieces:
            per_part[part] = per_part.get(part, 0) + n
    assert per_part == {0: 8, 1: 8, 2: 4}               # every part but the last is full
    for size, pieces in zip([5, 0, 12, 3], plan):        # pieces tile each file exactly
        assert sum(n for _, _, n in pieces) == size
        assert [o for _, o, _ in pieces] == [sum(n for _, _, n in pieces[:i]) for i in range(len(pieces))]
    with pytest.raises(ValueError):
        cp.plan_parts([1], 0)


def _payload(tmp: Path) -> list[tuple[str, Path]]:
    import os
    files = {"a.bin": os.urandom(3000), "sub/dir/b.bin": os.urandom(10_000), "empty.txt": b"", "c.txt": b"x" * 700}
    out = []
    for name, data in files.items():
        p = tmp / "src" / name.replace("/", "_")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out.append((name, p))
    return out


def _call(parts: Path, repo: Path, which: list[str]) -> Path:
    """One device call's tree: only the parts ``which`` under repo/carry."""
    shutil.rmtree(repo, ignore_errors=True)
    for w in which:
        shutil.copytree(parts / w, repo / "carry" / w)
    return repo / "carry"


def test_pack_assemble_over_calls(tmp_path):
    payload = _payload(tmp_path)
    m = cp.pack(payload, tmp_path / "carry", part_mib=4096 / cp.MIB)
    assert m["parts"] == ["p1", "p2", "p3", "p4"]        # 13,700 bytes in 4 KiB parts
    for p in m["parts"]:
        size = sum(f.stat().st_size for f in (tmp_path / "carry" / p).glob("f*"))
        assert size <= 4096 and (tmp_path / "carry" / p / "manifest.json").is_file()
    stage, dest, repo = tmp_path / "stage", tmp_path / "dest", tmp_path / "repo"
    st = cp.assemble(_call(tmp_path / "carry", repo, ["p3"]), stage, dest)
    assert st["seen"] == ["p3"] and st["ready"] == [] and st["missing_parts"] == ["p1", "p2", "p4"]
    st = cp.assemble(_call(tmp_path / "carry", repo, ["p1"]), stage, dest)
    assert st["ready"] == ["a.bin"]                      # whole in p1
    st = cp.assemble(_call(tmp_path / "carry", repo, ["p2", "p4"]), stage, dest)
    assert sorted(st["ready"]) == sorted(n for n, _ in payload) and st["missing"] == []
    assert st["seen"] == ["p1", "p2", "p3", "p4"]
    for name, src in payload:
        assert (dest / name).read_bytes() == src.read_bytes()
    again = cp.assemble(_call(tmp_path / "carry", repo, []), stage, dest)   # a later call with no part
    assert sorted(again["ready"]) == sorted(st["ready"])


def test_corrupt_piece_and_mixed_sets_raise(tmp_path):
    payload = _payload(tmp_path)
    cp.pack(payload, tmp_path / "carry", part_mib=8192 / cp.MIB)
    repo = tmp_path / "repo"
    carry = _call(tmp_path / "carry", repo, ["p1", "p2"])
    victim = sorted((carry / "p1").glob("f00.*"))[0]
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF                                        # same size, other content
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        cp.assemble(carry, tmp_path / "stage", tmp_path / "dest")
    victim.write_bytes(bytes(data[:-1]))                   # wrong size
    with pytest.raises(ValueError, match="bytes"):
        cp.assemble(carry, tmp_path / "stage2", tmp_path / "dest2")
    other = tmp_path / "other"
    cp.pack(payload[:1], other, part_mib=1)
    shutil.copytree(other / "p1", carry / "p9")
    with pytest.raises(ValueError, match="different carry sets"):
        cp.assemble(carry, tmp_path / "stage3", tmp_path / "dest3")


def test_pack_rejects_bad_names(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"1")
    for bad in ["../x", "/abs", ""]:
        with pytest.raises(ValueError):
            cp.pack([(bad, f)], tmp_path / "c", 1)
    with pytest.raises(ValueError, match="duplicate"):
        cp.pack([("x", f), ("x", f)], tmp_path / "c", 1)


def test_untar_and_cli(tmp_path, capsys):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        data = b"wheel bytes"
        info = tarfile.TarInfo("./w-1.0-py3-none-any.whl")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    arc = tmp_path / "w.tar.xz"
    arc.write_bytes(buf.getvalue())
    assert cp.untar(arc, tmp_path / "x") == ["./w-1.0-py3-none-any.whl"]
    assert (tmp_path / "x" / "w-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"
    src = tmp_path / "s.bin"
    src.write_bytes(b"y" * 100)
    assert cp.main(["pack", "--out", str(tmp_path / "c"), "--part-mib", str(64 / cp.MIB), f"s.bin={src}"]) == 0
    assert cp.main(["assemble", "--parts", str(tmp_path / "c"), "--stage", str(tmp_path / "st"),
                    "--dest", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "2 parts" in out and "ready 1/1 files" in out
    assert json.loads((tmp_path / "c" / "p1" / "manifest.json").read_text())["files"][0]["size"] == 100
