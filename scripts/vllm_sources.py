#!/usr/bin/env python3
"""Unpack the Python sources of the vLLM versions that have no CPU build, for the surface test.

    python scripts/vllm_sources.py                 every version with requirements/vllm-*/sources.txt
    python scripts/vllm_sources.py 0.34            one version
    python scripts/vllm_sources.py 0.34 --wheel W  from a wheel already on disk (its hash is checked)
    python scripts/vllm_sources.py 0.34 --record   rewrite sources.files (what the test imports)

For each version, ``requirements/vllm-V/sources.txt`` pins the wheel (``vllm==V --hash=sha256:...``).
pip downloads it (``--require-hashes``: pip refuses any other file) into a temporary folder; the
hash is checked again here; then only the files ``requirements/vllm-V/sources.files`` lists (the
``.py`` files ``tests/surface/check_names.py`` imports, a few hundred of the wheel's 3.6k) are
unpacked into ``.vllm-sources/V/`` and the wheel is deleted. A folder already unpacked from the
same hash with the same list is left as it is. ``scripts/setup.sh`` runs this; so does CI, on a
clean checkout.

``--record`` unpacks every ``vllm/**/*.py`` of the wheel into a temporary folder, runs the checker
there with an import recorder, and writes the files it imported to ``sources.files``: run it
when the names file (``tests/surface/mrv2_names.txt``) or a pinned version changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements"
DEST = REPO / ".vllm-sources"
CHECKER = REPO / "tests" / "surface" / "check_names.py"
PIN = re.compile(r"^vllm==(?P<version>[0-9.]+)\s+--hash=sha256:(?P<sha256>[0-9a-f]{64})\s*$")
STAMP = "SOURCES.json"


def versions() -> list[str]:
    return sorted(p.parent.name.removeprefix("vllm-") for p in REQUIREMENTS.glob("vllm-*/sources.txt"))


def pin(version: str) -> tuple[str, str]:
    """``(exact version, sha256)`` of the wheel ``sources.txt`` pins."""
    path = REQUIREMENTS / f"vllm-{version}" / "sources.txt"
    if not path.is_file():
        raise SystemExit(
            f"scripts/vllm_sources.py: no {path.relative_to(REPO)} (versions: {', '.join(versions())})"
        )
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            return match["version"], match["sha256"]
    raise SystemExit(f"{path.relative_to(REPO)}: no line 'vllm==X --hash=sha256:...'")


def listed(version: str) -> list[str]:
    path = REQUIREMENTS / f"vllm-{version}" / "sources.files"
    if not path.is_file():
        raise SystemExit(
            f"{path.relative_to(REPO)} is missing: run scripts/vllm_sources.py {version} --record"
        )
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(version: str, exact: str, sha256: str, folder: Path) -> Path:
    """The pinned wheel, downloaded by pip (which checks the hash) into ``folder``."""
    requirement = folder / "requirement.txt"
    requirement.write_text(f"vllm=={exact} --hash=sha256:{sha256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--require-hashes", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
        "--python-version", "3.11", "--implementation", "cp", "--abi", "abi3",
        "-r", str(requirement), "-d", str(folder),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    wheels = sorted(folder.glob(f"vllm-{exact}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"pip downloaded {[w.name for w in wheels]} for vllm=={exact}; expected one wheel")
    return wheels[0]


def unpack(version: str, wheel: Path, names: list[str] | None, target: Path) -> int:
    """Unpack ``names`` (every ``vllm/**/*.py`` when None) of ``wheel`` into ``target``."""
    exact, sha256 = pin(version)
    found = sha256_of(wheel)
    if found != sha256:
        raise SystemExit(
            f"{wheel}: sha256 {found} is not the one requirements/vllm-{version}/sources.txt pins"
        )
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        wanted = (
            names
            if names is not None
            else sorted(n for n in members if n.startswith("vllm/") and n.endswith(".py"))
        )
        missing = [name for name in wanted if name not in members]
        if missing:
            raise SystemExit(f"{wheel.name} has no {missing[:5]}; re-record sources.files")
        for name in wanted:
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(archive.read(name))
    return len(wanted)


def stamp(version: str, names: list[str]) -> dict[str, object]:
    exact, sha256 = pin(version)
    return {
        "version": exact,
        "sha256": sha256,
        "files": hashlib.sha256("\n".join(names).encode()).hexdigest(),
    }


def ensure(version: str, wheel: Path | None = None) -> Path:
    """``.vllm-sources/VERSION`` holding the listed files of the pinned wheel."""
    names = listed(version)
    target = DEST / version
    wanted = stamp(version, names)
    stamp_file = target / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == wanted:
        print(f"vllm_sources: vLLM {version} sources already in {target.relative_to(REPO)}")
        return target
    exact, sha256 = pin(version)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=DEST if DEST.exists() else None))
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
            source = wheel if wheel is not None else download(version, exact, sha256, Path(tmp))
            count = unpack(version, source, names, staging)
        (staging / STAMP).write_text(json.dumps(wanted, indent=1) + "\n")
        DEST.mkdir(exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"vllm_sources: vLLM {exact} ({sha256[:12]}...): {count} files in {target.relative_to(REPO)}")
    return target


RECORDER = """
import json, runpy, sys
root = sys.argv[1]
sys.argv = [sys.argv[2], sys.argv[3], root]
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    runpy.run_path(sys.argv[0], run_name="__main__")
files = sorted({m.__file__[len(root) + 1:] for m in list(sys.modules.values())
                if getattr(m, "__file__", None) and m.__file__.startswith(root + "/")})
print(json.dumps(files))
"""


def record(version: str, wheel: Path | None) -> None:
    """Rewrite ``sources.files``: the wheel's files the checker imports."""
    exact, sha256 = pin(version)
    with tempfile.TemporaryDirectory(prefix="vllm-record-") as tmp:
        root = Path(tmp) / "src"
        source = wheel if wheel is not None else download(version, exact, sha256, Path(tmp))
        unpack(version, source, None, root)
        env = {**os.environ, "PYTHONPATH": str(root)}
        out = subprocess.run(
            [sys.executable, "-c", RECORDER, str(root), str(CHECKER), version],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        files = json.loads(out.stdout.strip().splitlines()[-1])
    path = REQUIREMENTS / f"vllm-{version}" / "sources.files"
    header = [
        f"# The files of vllm-{exact}'s wheel that tests/surface/check_names.py imports, unpacked by",
        f"# scripts/vllm_sources.py. Rewritten by: scripts/vllm_sources.py {version} --record",
    ]
    path.write_text("\n".join(header + files) + "\n")
    print(f"vllm_sources: {len(files)} files of vLLM {exact} recorded in {path.relative_to(REPO)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "versions", nargs="*", help="vLLM versions (default: every requirements/vllm-*/sources.txt)"
    )
    parser.add_argument("--wheel", type=Path, help="the pinned wheel, already downloaded (one version only)")
    parser.add_argument("--record", action="store_true", help="rewrite sources.files from the whole wheel")
    args = parser.parse_args()
    chosen = args.versions or versions()
    if args.wheel is not None and len(chosen) != 1:
        parser.error("--wheel needs exactly one version")
    for version in chosen:
        if args.record:
            record(version, args.wheel)
        else:
            ensure(version, args.wheel)


if __name__ == "__main__":
    main()
