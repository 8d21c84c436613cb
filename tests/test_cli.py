"""The command line: build (Hydra), check, explain; no Hydra folders in the user's tree."""

from __future__ import annotations

import subprocess
import sys

from omnigen import paths

OMNIGEN = [sys.executable, "-m", "omnigen.cli"]


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNIGEN, *args], capture_output=True, text=True, cwd=cwd)


def test_help_lists_the_models():
    for args in (("--help",), ("build", "--help")):
        result = run(*args)
        assert result.returncode == 0
        for name in paths.model_names():
            assert name in result.stdout


def test_build_one_model_into_a_named_folder_leaves_no_hydra_output(tmp_path):
    result = run("build", "model=qwen3_omni", f"out={tmp_path / 'o'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "o" / "qwen3_omni").iterdir()) == [
        "__init__.py",
        "code2wav.py",
        "plan.yaml",
        "talker.py",
        "thinker.py",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no outputs/, multirun/, .hydra/


def test_multirun_sweep_writes_one_folder_per_cell(tmp_path):
    result = run(
        "build",
        "-m",
        "model=qwen3_tts,fish_speech",
        "graph=eager,full",
        f"out={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    cells = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert cells == [
        "graph=eager,model=fish_speech",
        "graph=eager,model=qwen3_tts",
        "graph=full,model=fish_speech",
        "graph=full,model=qwen3_tts",
    ]
    eager = (tmp_path / "sweep" / "graph=eager,model=qwen3_tts" / "qwen3_tts" / "qwen3_tts.py").read_text()
    full = (tmp_path / "sweep" / "graph=full,model=qwen3_tts" / "qwen3_tts" / "qwen3_tts.py").read_text()
    assert "full_graph_wrapper_cls" not in eager and "full_graph_wrapper_cls" in full
    assert "# Regenerate: omnigen build model=qwen3_tts \\\n#   graph=eager\n" in eager
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_multirun_without_an_output_folder_is_refused(tmp_path):
    result = run("build", "-m", "model=qwen3_tts,fish_speech", cwd=tmp_path)
    assert result.returncode != 0
    assert "out=DIR" in result.stdout + result.stderr


def test_a_sweep_checks_every_model_it_names_like_a_single_run(tmp_path):
    """Issue 9: ``-m model=../../x`` skipped the single-run checks and reached Hydra."""
    result = run("build", "-m", "model=../../x,qwen3_tts", f"out={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "conf/model/../../x.yaml: no such model config" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "sweep").exists()


def test_cfg_job_prints_the_composed_config_and_builds_nothing(tmp_path):
    result = run(
        "build", "model=qwen3_tts", "model.stages.qwen3_tts.mtp.graph=unsafe", "--cfg", "job", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "graph: unsafe" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_explain_shows_stages_decisions_reasons_and_serve_lines():
    result = run("explain", "model=qwen3_omni")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Qwen3OmniTalkerRunner" in out and "Qwen3OmniTalkerWorker" in out
    assert "mtp.graph=auto resolves to safe: the stage owns a separate talker module" in out
    assert "--worker-cls omnigen.generated.qwen3_omni.talker.Qwen3OmniTalkerWorker" in out
    assert "2.3" in out  # contract clauses per stage


def test_explain_follows_overrides():
    out = run("explain", "model=qwen3_omni", "model.stages.talker.mtp.graph=unsafe").stdout
    assert "mtp.graph=unsafe" in out


def test_unknown_model_and_missing_model_are_clear_errors():
    result = run("build", "model=nope")
    assert result.returncode == 2
    assert "conf/model/nope.yaml: no such model config; pick one of: fish_speech" in result.stderr
    result = run("explain")
    assert result.returncode == 2 and "omnigen explain model=NAME" in result.stderr
