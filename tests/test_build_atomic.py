"""A build is all or nothing, and says what is wrong (the build side of the issue "bad inputs
against the build"): a failure after the commit point is switched back, a path in the way is
named and wedges nothing, every bad model is reported, check calls a foreign file foreign,
Hydra's run folder stays out of the trees omnigen writes, and a sweep names the model that
refuses its overrides. (A build killed at any moment: tests/test_output_folders.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from omnigen import building, cli, paths, pipeline, render

ROOT = Path(__file__).resolve().parents[1]
OMNIGEN = [sys.executable, "-m", "omnigen.cli"]


def _tree(root: Path) -> dict[str, bytes | str]:
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


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*OMNIGEN, *args], cwd=cwd, env=env, capture_output=True, text=True)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


OLD = {
    "__init__.py": "old init\n",
    "a/f0.py": "old a0\n",
    "a/f1.py": "old a1\n",
    "a/gone.py": "removed by the new build\n",
    "b/g0.py": "old b0\n",
    "b/deep/g1.py": "old b1\n",
    "retired/x.py": "a model the new build no longer has\n",
}
NEW = {
    "__init__.py": "new init\n",
    "a/f0.py": "new a0\n",
    "a/f1.py": "old a1\n",  # unchanged: keeps its file (inode and mtime)
    "b/g0.py": "new b0\n",
    "b/deep/g1.py": "new b1\n",
    "c/h0.py": "a new model\n",
}


def _old_tree(root: Path) -> dict[str, bytes | str]:
    render.write_tree(root, OLD, scope=None)
    (root / "b" / "notes.txt").write_text("someone's notes\n")  # foreign: moves with b
    (root / "b" / "deep" / "mine").mkdir()  # an empty folder of someone's: kept too
    return _tree(root)


def _count_switch_steps(tmp_path: Path, monkeypatch) -> int:
    """How many moves (renames, exchanges, replaces) the switch from OLD to NEW makes."""
    root = tmp_path / "count"
    _old_tree(root)
    calls = []
    for name in ("_rename", "_exchange", "_replace"):
        real = getattr(render, name)
        monkeypatch.setattr(render, name, lambda *a, _real=real: (calls.append(a), _real(*a))[1])
    render.write_tree(root, NEW, scope=None)
    monkeypatch.undo()
    return len(calls)


def test_a_build_that_fails_at_any_step_after_its_commit_point_is_switched_back(tmp_path, monkeypatch):
    """Before, files were replaced one by one after the commit point with no rollback: a failure
    part-way left new and old files side by side. Now every step of the switch is made to fail
    in turn; each time the tree is the old one exactly (someone's files too), with nothing left
    behind, and the next build makes the new one."""
    steps = _count_switch_steps(tmp_path, monkeypatch)
    assert steps >= 6
    for failing in range(1, steps + 1):
        root = tmp_path / f"fail{failing}"
        before = _old_tree(root)
        calls = []
        for name in ("_rename", "_exchange", "_replace"):
            real = getattr(render, name)

            def step(*args, _real=real, _calls=calls, _failing=failing):
                _calls.append(args)
                if len(_calls) == _failing:
                    raise OSError(5, "Input/output error", str(args[0]))
                return _real(*args)

            monkeypatch.setattr(render, name, step)
        with pytest.raises(
            render.OutputFolderError, match="the build was switched back, and nothing was written"
        ):
            render.write_tree(root, NEW, scope=None)
        monkeypatch.undo()
        assert _tree(root) == before, f"step {failing}: the tree is the old one exactly"
        assert render.interrupted_build(root) == []
        render.write_tree(root, NEW, scope=None)
        after = {rel: data for rel, data in _tree(root).items() if rel != render.MANIFEST}
        assert after == {
            **{rel: text.encode() for rel, text in NEW.items()},
            "a": "<dir>",
            "b": "<dir>",
            "b/deep": "<dir>",
            "b/deep/mine": "<dir>",
            "b/notes.txt": b"someone's notes\n",
            "c": "<dir>",
        }


def test_a_build_that_cannot_switch_back_either_is_finished_by_the_next(tmp_path, monkeypatch):
    root = tmp_path / "out"
    _old_tree(root)
    calls = []
    real = render._exchange

    def failing_from_the_second(*args):
        calls.append(args)
        if len(calls) >= 2:
            raise OSError(5, "Input/output error", str(args[0]))
        return real(*args)

    monkeypatch.setattr(render, "_exchange", failing_from_the_second)
    with pytest.raises(render.OutputFolderError, match="nor switch back .* the next `omnigen build`"):
        render.write_tree(root, NEW, scope=None)
    monkeypatch.undo()
    assert (root / render.PENDING).is_file()
    for folder in ("a", "b"):  # each folder old or new, whole, never a mix
        text = {p.name: p.read_text() for p in (root / folder).glob("*.py")}
        old = {Path(r).name: t for r, t in OLD.items() if r.startswith(f"{folder}/") and r.count("/") == 1}
        new = {Path(r).name: t for r, t in NEW.items() if r.startswith(f"{folder}/") and r.count("/") == 1}
        assert text in (old, new), folder
    # The next build completes the switching back (the journal says so), then builds.
    render.write_tree(root, NEW, scope=None)
    assert render.interrupted_build(root) == []
    assert {rel: (root / rel).read_text() for rel in NEW} == NEW
    assert (root / "b" / "notes.txt").read_text() == "someone's notes\n"
    assert not (root / "a" / "gone.py").exists() and not (root / "retired").exists()


def test_a_build_that_fails_while_staging_a_folder_leaves_nothing(tmp_path, monkeypatch):
    root = tmp_path / "out"
    before = _old_tree(root)
    for name in ("_write_new", "_link_or_copy"):
        calls = []
        real = getattr(render, name)

        def fail_on_the_second(*args, _real=real, _calls=calls):
            _calls.append(args)
            if len(_calls) == 2:
                raise OSError(28, "No space left on device", str(args[0]))
            return _real(*args)

        monkeypatch.setattr(render, name, fail_on_the_second)
        with pytest.raises(
            render.OutputFolderError, match="No space left on device.*nothing was written or removed"
        ):
            render.write_tree(root, NEW, scope=None)
        monkeypatch.undo()
        assert _tree(root) == before, name


# -- a path in the way ------------------------------------------------------------------------------


def test_a_folder_in_the_way_is_named_and_wedges_no_later_build(tmp_path, monkeypatch, capsys):
    """Before, a folder where a generated file goes failed the build after its commit point, with
    a message naming omnigen's temporary file, and every later build failed the same way."""
    monkeypatch.chdir(tmp_path)
    assert _main(capsys, "build", "model=qwen3_tts", "out=out")[0] == 0
    (tmp_path / "out" / "qwen3_tts" / "plan.yaml").unlink()
    (tmp_path / "out" / "qwen3_tts" / "plan.yaml").mkdir()
    (tmp_path / "out" / "qwen3_tts" / "plan.yaml" / "mine.txt").write_text("mine\n")
    before = _tree(tmp_path)
    for _ in range(2):  # the second build is refused the same way: nothing wedged
        status, _, err = _main(capsys, "build", "model=qwen3_tts", "out=out")
        assert status == 2, err
        assert f"{tmp_path}/out/qwen3_tts/plan.yaml is in the way: omnigen writes a file there" in err
        assert f"Move or rename {tmp_path}/out/qwen3_tts/plan.yaml, then build again" in err
        assert ".tmp" not in err and "omnigen-" not in err.replace("omnigen-manifest", "")
        assert "nothing was written or removed" in err
        assert _tree(tmp_path) == before
    shutil.rmtree(tmp_path / "out" / "qwen3_tts" / "plan.yaml")
    assert _main(capsys, "build", "model=qwen3_tts", "out=out")[0] == 0
    assert _main(capsys, "check", "--root", "out")[0] == 0


@pytest.mark.parametrize(
    ("setup", "named", "what"),
    [
        (
            lambda out: (out / "qwen3_tts").write_text("a file\n"),
            "qwen3_tts",
            "a folder there, and this file",
        ),
        (
            lambda out: (out / "qwen3_tts" / "code2wav.py").write_text("my own code2wav\n"),
            "qwen3_tts/code2wav.py",
            "a file there, and this file",
        ),
        (
            lambda out: (out / "qwen3_tts").symlink_to(out.parent / "elsewhere"),
            "qwen3_tts",
            "a folder there, and this link",
        ),
    ],
    ids=[
        "a_file_where_the_model_folder_goes",
        "someones_file_where_a_generated_one_goes",
        "a_linked_model_folder",
    ],
)
def test_a_path_in_the_way_is_refused_before_anything_is_written(tmp_path, setup, named, what):
    out = tmp_path / "out"
    (out / "qwen3_tts").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "theirs.txt").write_text("theirs\n")
    (out / render.MANIFEST).write_text("# a folder omnigen wrote, with nothing in it yet\n")
    if named == "qwen3_tts":
        (out / "qwen3_tts").rmdir()
    setup(out)
    before = _tree(tmp_path)
    plan = pipeline.model_plan("qwen3_tts")
    with pytest.raises(render.OutputFolderError) as err:
        render.write_tree(out, pipeline.model_files(plan), scope=["qwen3_tts"])
    assert f"{out / named} is in the way: omnigen writes {what} is not one omnigen wrote" in str(err.value)
    assert _tree(tmp_path) == before


# -- every bad model, not the first ----------------------------------------------------------------


@pytest.fixture
def conf_with_two_bad_models(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(paths.conf_dir(), conf)
    for name, line in (("fish_speech", "no_such_key: 1"), ("qwen3_tts", "title: [not, a, title]")):
        path = conf / "model" / f"{name}.yaml"
        path.write_text(path.read_text() + f"\n{line}\n")
    monkeypatch.setattr(paths, "conf_dir", lambda: conf)
    return conf


def test_a_build_of_every_model_reports_every_bad_model_and_builds_none(
    conf_with_two_bad_models, tmp_path, monkeypatch, capsys
):
    """Before, ``omnigen build`` stopped at the first bad model. Decision: it reports them all and
    builds none (a build of every model is all or nothing, as a build of one is); exit status 2."""
    monkeypatch.chdir(tmp_path)
    status, _, err = _main(capsys, "build", "out=variant")
    assert status == 2
    count = len(paths.shipped_model_names())
    assert f"2 of {count} models have config problems, so none was built" in err
    assert "\n  model=fish_speech: " in err and "no_such_key" in err
    assert "\n  model=qwen3_tts: " in err and "title" in err
    assert "omnigen build model=NAME" in err
    assert not (tmp_path / "variant").exists()
    with pytest.raises(pipeline.ConfigError, match=r"(?s)model=fish_speech: .*model=qwen3_tts: "):
        building.every_model_files()  # what `omnigen build` (the committed tree) and `omnigen check` plan


def test_every_model_files_is_the_committed_tree():
    assert building.every_model_files() == pipeline.all_files()


# -- check's words match what build does ------------------------------------------------------------


def test_check_calls_a_foreign_file_foreign_and_an_orphaned_one_orphaned(tmp_path, capsys, monkeypatch):
    """Before, check called every file it did not expect "orphaned" and promised that a build
    removes it; a build (rightly) removes only what omnigen wrote."""
    monkeypatch.chdir(tmp_path)
    assert _main(capsys, "build", "model=qwen3_tts", "out=tree")[0] == 0
    tree = tmp_path / "tree"
    current = {rel: (tree / rel).read_text() for rel in render.owned_files(tree)}
    render.write_tree(
        tree, {**current, "qwen3_tts/old_stage.py": "# a stage omnigen wrote once\n"}, scope=None
    )
    (tree / "qwen3_tts" / "notes.txt").write_text("someone's notes\n")
    status, out, _ = _main(capsys, "check", "--root", "tree")
    assert status == 1
    assert (
        "orphaned: tree/qwen3_tts/old_stage.py   (omnigen wrote it and no longer generates it: a build removes it)"
        in out
    )
    assert "foreign:  tree/qwen3_tts/notes.txt   (not omnigen's: no build removes or changes it)" in out
    assert "orphaned: tree/qwen3_tts/notes.txt" not in out
    assert "fix: rebuild it, e.g. omnigen build model=qwen3_tts" in out
    assert "move them out of tree yourself, or delete them" in out
    # What check said is what the build does: the orphaned file goes, the foreign one stays.
    assert _main(capsys, "build", "model=qwen3_tts", "out=tree")[0] == 0
    assert not (tree / "qwen3_tts" / "old_stage.py").exists()
    assert (tree / "qwen3_tts" / "notes.txt").read_text() == "someone's notes\n"
    status, out, _ = _main(capsys, "check", "--root", "tree")
    assert status == 1
    assert (
        out.splitlines()[0]
        == "foreign:  tree/qwen3_tts/notes.txt   (not omnigen's: no build removes or changes it)"
    )
    assert "fix: rebuild it" not in out  # a build would not change what check reports


def test_check_says_when_a_build_would_refuse_the_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _main(capsys, "build", "model=qwen3_tts", "out=tree")[0] == 0
    (tmp_path / "tree" / "qwen3_tts" / "plan.yaml").unlink()
    (tmp_path / "tree" / "qwen3_tts" / "plan.yaml").mkdir()
    status, out, _ = _main(capsys, "check", "--root", "tree")
    assert status == 1
    assert "missing:  tree/qwen3_tts/plan.yaml" in out
    assert "a build would refuse this folder: tree/qwen3_tts/plan.yaml is in the way" in out
    assert "fix: Move or rename tree/qwen3_tts/plan.yaml, then build again" in out
    assert "fix: rebuild it" not in out


# -- Hydra's run folder, a sweep's overrides ---------------------------------------------------------


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_hydras_folder_inside_generated_is_refused_naming_the_key(tmp_path, sweep):
    """Before, ``hydra.run.dir=generated/x`` made generated/x (an empty folder of no one's in the
    committed tree) and built on."""
    inside = paths.generated_dir() / f"omnigen-test-{uuid.uuid4().hex[:8]}"
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    args = ["-m", "model=qwen3_tts", "graph=eager,full"] if sweep else ["model=qwen3_tts"]
    try:
        result = _run("build", *args, f"out={tmp_path / 'o'}", f"{key}={inside}", cwd=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"omnigen build: {key}={inside} is inside omnigen's generated tree" in result.stderr
        assert f"Point {key} outside it, or leave it unset" in result.stderr
        assert "Traceback" not in result.stderr
        assert not inside.exists() and not (tmp_path / "o").exists()
    finally:
        if inside.is_dir():
            shutil.rmtree(inside)


def test_hydras_run_folder_inside_the_output_folder_is_refused(tmp_path):
    result = _run("build", "model=qwen3_tts", "out=o", "hydra.run.dir=o/qwen3_tts", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "hydra.run.dir=o/qwen3_tts is inside the output folder (out=o)" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_override_one_model_refuses_names_that_model(tmp_path):
    """Before, the message said "the model has no stage 'talker'" without saying which model."""
    result = _run(
        "build",
        "-m",
        "model=qwen3_tts,qwen3_omni",
        "model.stages.talker.mtp.graph=unsafe",
        f"out={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "1 of the 2 models this sweep names refuse its overrides, so nothing was built" in result.stderr
    assert (
        "\n  model=qwen3_tts: override 'model.stages.talker.mtp.graph=unsafe': stages.talker.mtp.graph: "
        "the model has no stage 'talker'"
    ) in result.stderr
    assert "model=qwen3_omni:" not in result.stderr
    assert not (tmp_path / "sweep").exists()
