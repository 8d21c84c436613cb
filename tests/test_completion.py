"""Tab completion, typed into a real interactive bash and zsh (tmux), as a user would.

Each case starts the shell with only omnigen's completion installed (``eval "$(omnigen completion
SHELL)"``), types a partial command line, presses Tab and reads the line back from the screen.
Subcommands and option choices are Click's; models, config groups and keys are Hydra's; an enum
key's values come from the schema.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from omnigen import paths

BIN = Path(sys.executable).parent

CASES = [
    # (typed, what the line must read after Tab)
    ("omnigen bu", "omnigen build "),
    ("omnigen build model=qwen3_t", "omnigen build model=qwen3_tts "),
    (
        "omnigen build model=qwen3_tts model.stages.qwen3_tts.mt",
        "omnigen build model=qwen3_tts model.stages.qwen3_tts.mtp.",
    ),
    (
        "omnigen build model=qwen3_tts model.stages.qwen3_tts.mtp.graph=uns",
        "omnigen build model=qwen3_tts model.stages.qwen3_tts.mtp.graph=unsafe ",
    ),
    ("omnigen build model=qwen3_tts gra", "omnigen build model=qwen3_tts graph="),
    ("omnigen build model=qwen3_tts graph=ea", "omnigen build model=qwen3_tts graph=eager "),
    ("omnigen build --cfg jo", "omnigen build --cfg job "),
    ("omnigen explain model=fish_sp", "omnigen explain model=fish_speech "),
]

RC = {
    "bash": 'PS1="$ "\neval "$(omnigen completion bash)"\n',
    "zsh": 'PS1="$ "\nautoload -Uz compinit && compinit -u\neval "$(omnigen completion zsh)"\n',
}


def _shell_command(shell: str, home: Path) -> list[str]:
    env = ["env", "-i", f"PATH={BIN}:/usr/bin:/bin", f"HOME={home}", "TERM=xterm", f"ZDOTDIR={home}"]
    if shell == "bash":
        return [*env, "bash", "--noprofile", "--rcfile", str(home / ".bashrc"), "-i"]
    return [*env, "zsh", "-i"]


@pytest.fixture(params=["bash", "zsh"])
def shell(request, tmp_path):
    name = request.param
    if shutil.which(name) is None or shutil.which("tmux") is None:
        pytest.skip(f"{name} or tmux is not installed (scripts/setup.sh installs them on Debian as root)")
    (tmp_path / (".bashrc" if name == "bash" else ".zshrc")).write_text(RC[name])
    server = f"omnigen-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", server]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "t", "-x", "250", "-y", "20", *_shell_command(name, tmp_path)],
        check=True,
    )
    try:
        yield _Terminal(tmux)
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)


class _Terminal:
    def __init__(self, tmux: list[str]):
        self.tmux = tmux
        self.wait_for_prompt()

    def screen(self) -> list[str]:
        out = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", "t"], capture_output=True, text=True, check=True
        )
        return out.stdout.splitlines()

    def wait_for_prompt(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith("$") for line in self.screen()):
                return
            time.sleep(0.2)
        raise AssertionError(f"no prompt: {self.screen()}")

    def complete(self, typed: str, expected: str, timeout: float = 30) -> str:
        subprocess.run([*self.tmux, "send-keys", "-t", "t", "C-u", typed, "Tab"], check=True)
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            prompts = [line for line in self.screen() if line.startswith("$ ")]
            line = prompts[-1][2:] if prompts else ""
            # The cursor says whether a space followed (a finished word) or not (a key to go on with).
            if line == expected.rstrip() and self._cursor_col() == len("$ " + expected):
                return line
            time.sleep(0.3)
        raise AssertionError(f"typed {typed!r} + Tab: the line reads {line!r}, expected {expected!r}")

    def _cursor_col(self) -> int:
        out = subprocess.run(
            [*self.tmux, "display-message", "-p", "-t", "t", "#{cursor_x}"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.strip())


def test_tab_completes_subcommands_models_groups_keys_and_choices(shell):
    for typed, expected in CASES:
        shell.complete(typed, expected)


def test_tab_completes_the_models_of_a_config_dir(shell, tmp_path):
    own = tmp_path / "myconf"
    (own / "model").mkdir(parents=True)
    text = (
        (paths.conf_dir() / "model" / "qwen3_tts.yaml")
        .read_text()
        .replace("name: qwen3_tts", "name: zz_mine")
    )
    (own / "model" / "zz_mine.yaml").write_text(text)
    shell.complete(f"omnigen build -cd {own} model=zz", f"omnigen build -cd {own} model=zz_mine ")
