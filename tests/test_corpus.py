"""The corpus of bad input (tests/corpus/): every case is refused with exactly its expected findings.

Each expected line is a substring of the matching line of the message, in order, and the message
has no more findings than the case expects: all problems are reported at once, and nothing else.
The runtime cases (tests/corpus/runtime/) are run by tests/contract; the output folder and
filesystem cases by tests/test_corpus_folders.py.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from omnigen import paths, pipeline

CORPUS = Path(__file__).parent / "corpus"
CONFIG_FILES = sorted((CORPUS / "config_files").glob("*.yaml"))
OVERRIDES = yaml.safe_load((CORPUS / "overrides.yaml").read_text())


def findings_of(message: str) -> list[str]:
    """The message's findings, one per line (a single finding is the message itself)."""
    lines = message.splitlines()
    if re.fullmatch(r"\d+ problems in the config:", lines[0]):
        assert int(lines[0].split()[0]) == len(lines) - 1, message
        return [line.strip() for line in lines[1:]]
    assert len(lines) == 1, f"a single finding is one line: {message!r}"
    return lines


def assert_findings(message: str, expected: list[str]) -> None:
    got = findings_of(message)
    assert len(got) == len(expected), f"expected {len(expected)} findings, got:\n{message}"
    for line, text in zip(got, expected, strict=True):
        assert text in line, f"expected {text!r} in {line!r}"
    assert "Traceback" not in message


def expected_of(case: Path) -> list[str]:
    sidecar = case.with_suffix(".expect")
    if sidecar.exists():  # a file whose first bytes are a byte-order mark cannot start with a comment
        return sidecar.read_text().splitlines()
    lines = case.read_bytes().splitlines()
    return [line.decode().removeprefix("# expect: ") for line in lines if line.startswith(b"# expect: ")]


@pytest.fixture
def conf_root(tmp_path, monkeypatch):
    """A copy of conf/ used as the config root, so a case's file joins the models."""
    root = tmp_path / "conf"
    shutil.copytree(paths.conf_dir(), root)
    monkeypatch.setattr(paths, "conf_dir", lambda: root)
    return root


@pytest.mark.parametrize("case", CONFIG_FILES, ids=lambda p: p.stem)
def test_a_bad_config_file_is_refused_with_every_finding(case, conf_root):
    expected = expected_of(case)
    assert expected, f"{case.name} states no expected message"
    shutil.copy(case, conf_root / "model" / case.name)
    started = time.perf_counter()
    with pytest.raises(pipeline.ConfigError) as info:
        pipeline.model_plan(case.stem)
    assert time.perf_counter() - started < 5, "an alias bomb or deep file must be refused fast"
    assert_findings(str(info.value), expected)


@pytest.mark.parametrize(
    "case", OVERRIDES, ids=[f"{c['model']}:{' '.join(c['overrides'])}" for c in OVERRIDES]
)
def test_bad_overrides_are_refused_with_every_finding(case):
    with pytest.raises(pipeline.ConfigError) as info:
        if case.get("multirun"):
            pipeline.check_model_name(case["model"], case["overrides"], sweeps_allowed=True)
        else:
            pipeline.model_plan(case["model"], case["overrides"])
    assert_findings(str(info.value), case["expect"])


def test_a_file_too_big_to_be_a_config_is_refused_before_it_is_parsed(conf_root):
    (conf_root / "model" / "too_big.yaml").write_text("name: too_big\n# " + "x" * 300_000 + "\n")
    with pytest.raises(
        pipeline.ConfigError, match=r"conf/model/too_big.yaml: 300017 bytes; a model config is at most"
    ):
        pipeline.model_plan("too_big")


def test_the_corpus_is_as_large_as_issue_9_asks():
    runtime = list((CORPUS / "runtime").glob("*.yaml")) if (CORPUS / "runtime").is_dir() else []
    folders = yaml.safe_load((CORPUS / "output_folders.yaml").read_text())
    sizes = {"config files": len(CONFIG_FILES), "overrides": len(OVERRIDES), "output folders": len(folders)}
    assert sizes["config files"] >= 80 and sizes["overrides"] >= 50 and sizes["output folders"] >= 20, sizes
    assert sum(sizes.values()) + len(runtime) >= 150
