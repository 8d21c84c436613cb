"""The command line (Click, with Hydra behind build): every command, flag and output of issue 10."""

from __future__ import annotations

import csv
import fcntl
import importlib.metadata
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

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
        "code2wav_v2.py",
        "plan.yaml",
        "talker.py",
        "talker_v2.py",
        "thinker.py",
        "thinker_v2.py",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no outputs/, multirun/, .hydra/


def test_multirun_sweep_writes_one_package_per_cell_a_line_each_and_a_csv(tmp_path):
    result = run(
        "build",
        "-m",
        "model=qwen3_tts,fish_speech",
        "graph=eager,full",
        f"out={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    cells = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert cells == [
        "graph_eager__model_fish_speech",
        "graph_eager__model_qwen3_tts",
        "graph_full__model_fish_speech",
        "graph_full__model_qwen3_tts",
    ]
    eager = (tmp_path / "sweep" / "graph_eager__model_qwen3_tts" / "qwen3_tts" / "qwen3_tts.py").read_text()
    full = (tmp_path / "sweep" / "graph_full__model_qwen3_tts" / "qwen3_tts" / "qwen3_tts.py").read_text()
    assert "full_graph_wrapper_cls" not in eager and "full_graph_wrapper_cls" in full
    assert "# Regenerate: omnigen build model=qwen3_tts \\\n#   graph=eager\n" in eager
    # Each cell is a package of its own: its serve line names it, not the committed tree.
    assert "--worker-cls sweep.graph_eager__model_qwen3_tts.qwen3_tts.qwen3_tts.Qwen3TtsWorker" in eager
    assert "omnigen.generated" not in eager
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    # One line per cell: ok, its package, the decisions that differ between the cells.
    lines = result.stdout.splitlines()
    assert (
        "ok      graph=eager,model=qwen3_tts  (sweep.graph_eager__model_qwen3_tts)  "
        "qwen3_tts/qwen3_tts/mtp.graph=unsafe, qwen3_tts/qwen3_tts/mtp.per_row_generators=always"
    ) in lines
    assert (
        "ok      graph=full,model=fish_speech  (sweep.graph_full__model_fish_speech)  fish_speech/slow_ar/mtp.graph=safe"
        in lines
    )
    assert lines[-1] == f"4 ok, 0 failed; cells x decisions: {tmp_path / 'sweep' / 'omnigen-sweep.csv'}"
    assert "overriding with `hydra.mode=MULTIRUN`" not in result.stderr
    with open(tmp_path / "sweep" / "omnigen-sweep.csv", newline="") as table:
        rows = list(csv.DictReader(table))
    assert [r["cell"] for r in rows] == [
        "graph=eager,model=qwen3_tts",
        "graph=full,model=qwen3_tts",
        "graph=eager,model=fish_speech",
        "graph=full,model=fish_speech",
    ]
    assert [r["qwen3_tts/qwen3_tts/mtp.graph"] for r in rows] == ["unsafe", "safe", "", ""]
    assert [r["fish_speech/slow_ar/mtp.graph"] for r in rows] == ["", "", "unsafe", "safe"]
    assert {r["status"] for r in rows} == {"ok"}


def test_a_failing_cell_is_a_message_and_the_exit_status_counts_failures(tmp_path):
    result = run(
        "build",
        "-m",
        "model=qwen3_tts",
        "model.stages.qwen3_tts.order=200,0,300",
        f"out={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("failed  ")]
    assert len(failed) == 2
    assert failed[0].startswith(
        "failed  model.stages.qwen3_tts.order=200,model=qwen3_tts  2 problems in the config"
    )
    assert "stages.qwen3_tts.order: 200 is out of range" in result.stdout
    assert "1 ok, 2 failed" in result.stdout
    with open(tmp_path / "sweep" / "omnigen-sweep.csv", newline="") as table:
        assert [r["status"] for r in csv.DictReader(table)] == ["failed", "ok", "failed"]


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


# -- issue 10: the command line on Click and Hydra ---------------------------------------------------


def test_version_is_omnigens():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"omnigen, version {importlib.metadata.version('omnigen')}"


@pytest.mark.parametrize("command", ["build", "explain", "run", "serve"])
def test_each_command_help_lists_its_options_the_models_and_the_groups(command):
    result = run(command, "model=qwen3_tts", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: omnigen {command} [OPTIONS]")
    assert "hydra_app" not in result.stdout
    for name in paths.model_names():
        assert name in result.stdout
    assert "graph=OPTION   as_configured, eager, full" in result.stdout
    assert "device=OPTION  auto, cpu, cuda" in result.stdout
    if command == "build":
        for flag in (
            "-cp, --config-path",
            "-cn, --config-name",
            "-cd, --config-dir",
            "-c, --cfg [job|hydra|all]",
        ):
            assert flag in result.stdout
        for flag in ("-p, --package", "--resolve", "-i, --info", "-m, --multirun", "-q, --quiet"):
            assert flag in result.stdout


def test_a_closed_pipe_is_not_a_traceback():
    for args in (["--help"], ["explain", "model=qwen3_omni"], ["build", "model=qwen3_tts", "--cfg", "job"]):
        reader = subprocess.Popen([*OMNIGEN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        reader.stdout.readline()
        reader.stdout.close()  # `| head -1`
        err = reader.stderr.read().decode()
        reader.wait(timeout=60)
        assert "Traceback" not in err and "BrokenPipeError" not in err, (args, err)


def test_hydra_flags_work_as_hydra_documents_them(tmp_path):
    cfg = run("build", "model=qwen3_tts", "--cfg", "job", "-p", "model.stages.qwen3_tts.mtp")
    assert cfg.returncode == 0 and cfg.stdout.startswith(
        "# @package model.stages.qwen3_tts.mtp\nenabled: true"
    )
    hydra_cfg = run("build", "model=qwen3_tts", "--cfg", "hydra")
    assert (
        hydra_cfg.returncode == 0
        and "job_logging:" in hydra_cfg.stdout
        and "\nmodel:" not in hydra_cfg.stdout
    )
    everything = run("build", "model=qwen3_tts", "--cfg", "all", "--resolve")
    assert (
        everything.returncode == 0
        and "hydra:" in everything.stdout
        and "name: qwen3_tts" in everything.stdout
    )
    assert "${oc.env:TMPDIR" not in everything.stdout  # --resolve resolved the run folder
    info = run("build", "model=qwen3_tts", "--info", "searchpath")
    assert info.returncode == 0 and f"file://{paths.conf_dir()}" in info.stdout
    assert run("build", "--info", "plugins").returncode == 0
    no_model = run("build", "--info")
    assert no_model.returncode == 2 and "--info needs a model to compose: add model=NAME" in no_model.stderr
    assert "Traceback" not in no_model.stderr
    # -cp and -cn: a primary config of one's own (here: a copy of omnigen's, renamed).
    own = tmp_path / "primary"
    shutil.copytree(paths.conf_dir(), own)
    (own / "config.yaml").rename(own / "mine.yaml")
    cp = run("build", "-cp", str(own), "-cn", "mine", "model=qwen3_tts", "--cfg", "job", "-p", "model.name")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip().endswith("qwen3_tts")
    missing = run("build", "-cp", str(own), "model=qwen3_tts", "--cfg", "job")
    assert missing.returncode != 0 and "Cannot find primary config 'config'" in missing.stderr
    verbose = run("build", "model=qwen3_tts", f"out={tmp_path / 'v'}", "hydra.verbose=true")
    assert verbose.returncode == 0 and "[HYDRA] Installed Hydra Plugins" in verbose.stdout


def _own_model(tmp_path: Path) -> Path:
    own = tmp_path / "myconf"
    (own / "model").mkdir(parents=True)
    text = (
        (paths.conf_dir() / "model" / "qwen3_tts.yaml").read_text().replace("name: qwen3_tts", "name: mine")
    )
    (own / "model" / "mine.yaml").write_text(text)
    return own


def test_a_config_dir_adds_models_and_the_output_names_the_right_modules(tmp_path):
    own = _own_model(tmp_path)
    out = tmp_path / "my_runners"
    result = run("build", "-cd", str(own), "model=mine", f"out={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    talker = (out / "mine" / "qwen3_tts.py").read_text()
    assert "from myconf/model/mine.yaml" in talker.splitlines()[0]
    assert "--worker-cls my_runners.mine.qwen3_tts.MineQwen3TtsWorker" in talker
    assert "omnigen.generated" not in talker
    workers = subprocess.run(
        [
            sys.executable,
            "-c",
            "import my_runners.mine as m, importlib; "
            "[getattr(importlib.import_module(w.rsplit('.', 1)[0]), w.rsplit('.', 1)[1]) for w in m.WORKERS.values()]; "
            "print(sorted(m.WORKERS.values()))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert workers.returncode == 0, workers.stderr
    assert "my_runners.mine.code2wav.MineCode2wavWorker" in workers.stdout
    # The same model through the documented search path, and the commands that read configs.
    env = {**os.environ, "OMNIGEN_CONFIG_PATH": str(own)}
    explain = subprocess.run([*OMNIGEN, "explain", "model=mine"], capture_output=True, text=True, env=env)
    assert explain.returncode == 0 and "from myconf/model/mine.yaml" not in explain.stdout
    assert f"{own}/model/mine.yaml" in explain.stdout.splitlines()[0]
    from_path = subprocess.run(
        [*OMNIGEN, "build", "model=mine", f"out={tmp_path / 'by_path'}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert from_path.returncode == 0, from_path.stderr
    assert (tmp_path / "by_path" / "mine" / "qwen3_tts.py").read_text() == talker.replace(
        "my_runners.", "by_path."
    )
    listed = subprocess.run([*OMNIGEN, "build", "--help"], capture_output=True, text=True, env=env)
    assert "mine" in listed.stdout
    assert (
        run("build", "-cd", str(own), "model=mine", "--cfg", "job", "-p", "model.name").stdout.strip()
        == "mine"
    )
    sweep = run(
        "build", "-m", "-cd", str(own), "model=mine,qwen3_tts", f"out={tmp_path / 'sw'}", cwd=tmp_path
    )
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    # Its runners never go into omnigen's own generated/.
    refused = run("build", "-cd", str(own), "model=mine", cwd=tmp_path)
    assert (
        refused.returncode == 2 and "a model of your own is built into a folder of your own" in refused.stderr
    )
    assert not (paths.generated_dir() / "mine").exists()


def test_new_model_writes_a_config_with_every_key_documented_that_builds(tmp_path):
    result = run("new", "model", "my_tts", "-cd", str(tmp_path / "conf"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "conf" / "model" / "my_tts.yaml").read_text()
    from omnigen import keys

    flat = " ".join(line.strip("# ").strip() for line in text.splitlines() if line.lstrip().startswith("#"))
    for key in keys.schema_keys():
        if key.path.startswith("model."):
            leaf = key.path.rsplit(".", 1)[-1]
            assert f"{leaf}:" in text, key.path
            assert " ".join(key.doc.split()[:6]) in flat, key.path
    assert run("new", "model", "my_tts", "-cd", str(tmp_path / "conf")).returncode == 2  # never overwritten
    built = run("build", "-cd", str(tmp_path / "conf"), "model=my_tts", f"out={tmp_path / 'my_tts_runners'}")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "my_tts_runners" / "my_tts" / "talker.py").is_file()


def test_a_variant_is_a_package_checked_against_its_recorded_overrides(tmp_path):
    out = tmp_path / "acme" / "variants"
    result = run("build", "model=qwen3_tts", "graph=eager", f"out={out}", "package=acme.variants")
    assert result.returncode == 0, result.stderr
    init = (out / "qwen3_tts" / "__init__.py").read_text()
    assert '"qwen3_tts": "acme.variants.qwen3_tts.qwen3_tts.Qwen3TtsWorker"' in init
    assert "acme.variants.qwen3_tts.code2wav" in (out / "qwen3_tts" / "plan.yaml").read_text()
    check = run("check", "--root", str(out))
    assert check.returncode == 0, check.stdout
    assert "is up to date (variant acme.variants: qwen3_tts)" in check.stdout
    talker = out / "qwen3_tts" / "qwen3_tts.py"
    talker.write_text(talker.read_text() + "# edit\n")
    stale = run("check", "--root", str(out))
    assert stale.returncode == 1 and "stale:    variants/qwen3_tts/qwen3_tts.py" in stale.stdout
    assert f"omnigen build model=qwen3_tts graph=eager out={out}" in stale.stdout
    wrong = run("build", "model=qwen3_tts", f"out={tmp_path / 'x'}", "package=acme.variants")
    assert wrong.returncode == 2 and "so the folder must end in acme/variants" in wrong.stderr
    unnamed = run("build", "model=qwen3_tts", f"out={tmp_path / 'not-a-name'}")
    assert unnamed.returncode == 2 and "is not a Python package name" in unnamed.stderr


def test_diff_shows_decisions_that_differ_between_cells_and_the_committed_tree(tmp_path):
    sweep = run("build", "-m", "model=qwen3_tts", "graph=eager,full", f"out={tmp_path / 'sw'}")
    assert sweep.returncode == 0, sweep.stderr
    eager, full = (
        tmp_path / "sw" / "graph_eager__model_qwen3_tts",
        tmp_path / "sw" / "graph_full__model_qwen3_tts",
    )
    two = run("diff", str(eager), str(full))
    assert two.returncode == 1
    rows = [line.split() for line in two.stdout.splitlines() if line.startswith("qwen3_tts/")]
    assert [r[:4] for r in rows] == [
        ["qwen3_tts/qwen3_tts", "mtp.graph", "unsafe", "safe"],
        ["qwen3_tts/qwen3_tts", "mtp.per_row_generators", "always", "eager_only"],
    ]
    assert "A: " in two.stdout and "qwen3_tts: graph=eager" in two.stdout
    committed = run("diff", str(full))
    assert committed.returncode == 0 and "same decisions in every stage" in committed.stdout
    assert "(the committed tree)" in committed.stdout


def test_explain_keys_and_json_come_from_the_schema():
    from omnigen import keys

    text = run("explain", "--keys")
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    for key in keys.schema_keys():
        assert any(line.startswith(key.path + " ") for line in lines), key.path
    graph = next(line for line in lines if line.startswith("model.stages.STAGE.mtp.graph "))
    assert graph.split()[1:5] == ["enum", "auto", "auto", "|"] and "safe | unsafe" in graph
    data = json.loads(run("explain", "--keys", "--format", "json").stdout)
    entry = next(k for k in data if k["key"] == "model.stages.STAGE.order")
    assert entry["type"] == "int" and entry["required"] and entry["default"] == "???"
    assert entry["doc"].startswith("Position of the stage in the pipeline")
    plan = json.loads(run("explain", "model=qwen3_omni", "--format", "json").stdout)
    assert plan["stages"]["talker"]["decisions"]["mtp.graph"]["value"] == "safe"
    assert plan["package"] == "omnigen.generated"


def test_explain_wraps_its_tables_to_the_terminal(tmp_path):
    """A real terminal (a pty) 72 columns wide: no line of a table is wider."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 72, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [*OMNIGEN, "explain", "model=qwen3_omni"], stdout=secondary, stderr=subprocess.PIPE, env=env
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=60) == 0
    os.close(main)
    lines = b"".join(chunks).decode().replace("\r\n", "\n").splitlines()
    assert "Decisions:" in lines
    wide = [line for line in lines if len(line) > 72 and "vllm serve" not in line]
    assert wide == []
    # The same command into a pipe: one row a line, whatever the terminal.
    piped = run("explain", "model=qwen3_omni").stdout.splitlines()
    assert any(
        "mtp.graph=auto resolves to safe: the stage owns a separate talker module" in line for line in piped
    )


def test_logging_quiet_job_logging_and_progress(tmp_path):
    loud = run("build", "model=qwen3_tts", f"out={tmp_path / 'a'}")
    assert "  wrote   qwen3_tts/qwen3_tts.py" in loud.stderr and loud.stdout == ""
    quiet = run("build", "-q", "model=qwen3_tts", f"out={tmp_path / 'b'}")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""
    disabled = run("build", "model=qwen3_tts", f"out={tmp_path / 'c'}", "hydra/job_logging=disabled")
    assert disabled.returncode == 0 and "wrote" not in disabled.stderr + disabled.stdout
    out = tmp_path / "omnigen" / "generated"
    every = run("build", f"out={out}", "package=omnigen.generated")
    assert every.returncode == 0, every.stderr
    models = paths.shipped_model_names()
    for i, name in enumerate(models):
        assert f"omnigen: [{i + 1}/{len(models)}] {name}" in every.stderr
    assert run("-q", "build", f"out={out}", "package=omnigen.generated").stderr == ""


def test_hydras_shell_completion_flag_prints_omnigens_script():
    for shell in ("bash", "zsh"):
        hydra_way = run("build", "-sc", f"install={shell}")
        assert hydra_way.returncode == 0, hydra_way.stderr
        assert hydra_way.stdout == run("completion", shell).stdout
        assert "_OMNIGEN_COMPLETE" in hydra_way.stdout and "-sc query" not in hydra_way.stdout
