"""tests/corpus/output_folders.yaml: output folders and filesystem faults (issue 9, items 1 and 3).

Each case runs `omnigen build model=qwen3_tts out=OUT` in process, in a fresh directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from omnigen import cli, render

CASES = yaml.safe_load((Path(__file__).parent / "corpus" / "output_folders.yaml").read_text())


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root``: a file's bytes, a symlink's target, a folder's marker."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[rel] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[rel] = path.read_bytes()
        elif "__pycache__" not in path.parts:
            found[rel] = "<dir>"
    return found


def build(out: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main(["build", "model=qwen3_tts", f"out={out}"])
    return status, capsys.readouterr().err


def set_up(case: dict, where: Path) -> None:
    for rel in case.get("dirs", []):
        (where / rel).mkdir(parents=True, exist_ok=True)
    for rel, text in case.get("files", {}).items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    for rel, text in case.get("bytes", {}).items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(text.encode("latin-1"))
    for rel, target in case.get("symlinks", {}).items():
        (where / rel).unlink(missing_ok=True)
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).symlink_to(target)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_an_output_folder_case(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = case.get("out", "out")
    if case.get("built_first"):
        assert build(out, capsys)[0] == 0
    set_up(case, tmp_path)
    written = {**case.get("files", {}), **{rel: text for rel, text in case.get("bytes", {}).items()}}
    keep = [rel for rel in written if not rel.startswith("out/") and rel != "out" or "mine" in rel]
    before = snapshot(tmp_path)
    status, message = build(out, capsys)
    assert "Traceback" not in message
    if case.get("ok"):
        assert status == 0, message
        root = tmp_path / out
        assert render.check_tree(root, render_files(root)).interrupted == []
        for rel in case.get("kept", []):
            assert (tmp_path / rel).exists(), rel
        for rel in case.get("gone", []):
            assert not (tmp_path / rel).exists(), rel
        for rel in case.get("symlinks", {}):  # a symlinked file is replaced, its target untouched
            assert not (tmp_path / rel).is_symlink() or rel == out
    else:
        assert status == 2, message
        assert case["expect"] in message, message
        assert snapshot(tmp_path) == before, "a refused build changes nothing"
    for rel in keep:
        assert (tmp_path / rel).read_bytes() == before[rel], f"{rel} was changed"


def render_files(root: Path) -> dict[str, str]:
    """What the build wrote under ``root``, by its manifest (for the leftover check)."""
    return {rel: (root / rel).read_text() for rel in render.owned_files(root) if (root / rel).is_file()}
