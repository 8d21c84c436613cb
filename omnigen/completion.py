"""Tab completion: Click's for commands and options, Hydra's for overrides (groups, models, keys).

``eval "$(omnigen completion bash)"`` (or ``zsh``) installs it. Subcommands, options and option
choices are Click's own completion; an override word (``model=qw``, ``model.stages.``) is completed
by Hydra's completion plugin on the config the words before it compose, as Hydra's ``-sc`` would.

Bash's readline splits words at ``=`` and ``:`` (``COMP_WORDBREAKS``) and Hydra's overrides are
``key=value``, so the bash script sends the line up to the cursor and the break characters: the
whole override is completed, and bash gets back each match from where readline's word starts
(after the last break character), as bash-completion's ``__ltrim_colon_completions`` does. A match that ends in ``=``
or ``.`` (a group or a key with more under it) gets no trailing space, in bash and in zsh.
"""

from __future__ import annotations

import os

import click
from click.shell_completion import BashComplete, CompletionItem, ZshComplete, split_arg_string

_BASH_SOURCE = """\
%(complete_func)s() {
    local IFS=$'\\n'
    local response

    response=$(env COMP_LINE="${COMP_LINE:0:$COMP_POINT}" COMP_WORDBREAKS="$COMP_WORDBREAKS" \
%(complete_var)s=bash_complete $1)

    for completion in $response; do
        IFS=',' read type value <<< "$completion"

        if [[ $type == 'dir' ]]; then
            COMPREPLY=()
            compopt -o dirnames
        elif [[ $type == 'file' ]]; then
            COMPREPLY=()
            compopt -o default
        elif [[ $type == 'plain' ]]; then
            COMPREPLY+=($value)
            [[ $value == *= || $value == *. ]] && compopt -o nospace
        fi
    done

    return 0
}

%(complete_func)s_setup() {
    complete -o nosort -F %(complete_func)s %(prog_name)s
}

%(complete_func)s_setup;
"""

_ZSH_SOURCE = """\
#compdef %(prog_name)s

%(complete_func)s() {
    local -a completions
    local -a open_completions
    local -a completions_with_descriptions
    local -a response
    (( ! $+commands[%(prog_name)s] )) && return 1

    response=("${(@f)$(env COMP_WORDS="${words[*]}" COMP_CWORD=$((CURRENT-1)) \
%(complete_var)s=zsh_complete %(prog_name)s)}")

    for type key descr in ${response}; do
        if [[ "$type" == "plain" ]]; then
            if [[ "$key" == *= || "$key" == *. ]]; then
                open_completions+=("$key")
            elif [[ "$descr" == "_" ]]; then
                completions+=("$key")
            else
                completions_with_descriptions+=("$key":"$descr")
            fi
        elif [[ "$type" == "dir" ]]; then
            _path_files -/
        elif [[ "$type" == "file" ]]; then
            _path_files -f
        fi
    done

    if [ -n "$completions_with_descriptions" ]; then
        _describe -V unsorted completions_with_descriptions -U
    fi

    if [ -n "$completions" ]; then
        compadd -U -V unsorted -a completions
    fi

    if [ -n "$open_completions" ]; then
        compadd -U -S '' -V unsorted -a open_completions
    fi
}

if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    # autoload from fpath, call function directly
    %(complete_func)s "$@"
else
    # eval/source/. command, register function for later
    compdef %(complete_func)s %(prog_name)s
fi
"""


class OmnigenBashComplete(BashComplete):
    """Click's bash completion, reading the line (not bash's ``=``-split words)."""

    source_template = _BASH_SOURCE

    def get_completion_args(self) -> tuple[list[str], str]:
        line = os.environ.get("COMP_LINE", "")
        words = split_arg_string(line)
        incomplete = "" if not line or line[-1].isspace() else (words.pop() if words else "")
        breaks = os.environ.get("COMP_WORDBREAKS") or _DEFAULT_WORDBREAKS
        self._strip = max((incomplete.rfind(c) + 1 for c in breaks if not c.isspace()), default=0)
        return words[1:], incomplete

    def format_completion(self, item: CompletionItem) -> str:
        return f"{item.type},{item.value[self._strip :]}"


_DEFAULT_WORDBREAKS = " \t\n\"'><=;|&(:"


class OmnigenZshComplete(ZshComplete):
    source_template = _ZSH_SOURCE


SHELLS = {"bash": OmnigenBashComplete, "zsh": OmnigenZshComplete}


def register() -> None:
    for cls in SHELLS.values():
        click.shell_completion.add_completion_class(cls, cls.name)


def script(command: click.Command, shell: str) -> str:
    return SHELLS[shell](command, {}, "omnigen", "_OMNIGEN_COMPLETE").source()


def complete_overrides(
    config_dirs: list[str], words: list[str], incomplete: str, *, multirun: bool
) -> list[str]:
    """Hydra's completion of ``incomplete`` after the override ``words``: groups, options, keys."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.plugins.completion_plugin import DefaultCompletionPlugin

    from omnigen import paths
    from omnigen.schema import register_configs

    choices = _schema_choices(incomplete)
    if choices is not None:
        return choices
    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    paths.set_extra_config_dirs([os.path.abspath(d) for d in config_dirs])
    searchpath = [f"file://{d}" for d in paths.extra_config_dirs()]
    prefix = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    line = " ".join([*(["-m"] if multirun else []), *prefix, *words, incomplete])
    try:
        with initialize_config_dir(config_dir=str(paths.conf_dir()), version_base="1.3"):
            plugin = DefaultCompletionPlugin(GlobalHydra.instance().config_loader())
            return plugin._query(config_name="config", line=line)
    except Exception:  # noqa: BLE001 - a completion that cannot compose offers nothing, never a traceback
        return []
    finally:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()


def _schema_choices(incomplete: str) -> list[str] | None:
    """``KEY=`` of an enum or bool key: its choices from the schema (Hydra offers only the current value)."""
    import re

    from omnigen import keys

    key, sep, typed = incomplete.partition("=")
    if not sep:
        return None
    pattern = re.sub(r"^(\+|\+\+)?model\.stages\.[^.]+\.", "model.stages.STAGE.", key.lstrip("+"))
    for known in keys.schema_keys():
        if known.path == pattern:
            options = list(known.choices) or (["true", "false"] if known.type.startswith("bool") else [])
            if not options:
                return None
            return [f"{key}={o}" for o in options if o.startswith(typed)]
    return None
