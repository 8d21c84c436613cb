"""The glue registry, its lookup errors, and the rule that nothing in omnigen.glue imports vllm-omni."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import omnigen.glue
from omnigen.glue import GLUE, VLLM_OMNI_EQUIVALENTS, UnknownGlueError, resolve

GLUE_DIR = Path(omnigen.glue.__file__).parent


def test_names_are_the_functions_dotted_paths():
    for name, function in GLUE.items():
        module, attribute = name.rsplit(".", 1)
        assert getattr(importlib.import_module(module), attribute) is function
        assert resolve(name) is function


def test_every_function_names_its_vllm_omni_counterparts():
    assert set(VLLM_OMNI_EQUIVALENTS) == set(GLUE)
    for theirs in VLLM_OMNI_EQUIVALENTS.values():
        assert all(path.startswith("vllm_omni.model_executor.stage_input_processors.") for path in theirs)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownGlueError) as caught:
        resolve("omnigen.glue.qwen3_tts.talker_to_code2wav")
    message = str(caught.value)
    assert "unknown glue function 'omnigen.glue.qwen3_tts.talker_to_code2wav'" in message
    for name in GLUE:
        assert f"\n  {name}" in message


def test_a_vllm_omni_name_points_at_omnigens_version():
    name = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_full_payload"
    with pytest.raises(KeyError, match=r"omnigen's version: omnigen\.glue\.qwen3_omni\.thinker2talker"):
        resolve(name)


def test_no_module_imports_vllm_omni():
    for path in sorted(GLUE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name.split(".")[0] == "vllm_omni" for name in names), (
                f"{path.name}: imports {names}"
            )


def test_importing_and_resolving_everything_loads_no_vllm_omni():
    script = (
        "import sys, omnigen.glue as g\n"
        "[g.resolve(n) for n in g.GLUE]\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm_omni' or m.startswith('vllm_omni.'))\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
