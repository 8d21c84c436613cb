"""Check ``mrv2_names.txt`` against one vLLM version's Python sources, in a process of its own.

Run as ``python tests/surface/check_names.py VERSION SOURCES_DIR`` with ``SOURCES_DIR`` (an
unpacked wheel's ``vllm`` package, ``scripts/vllm_sources.py``) first on ``sys.path``; prints one
JSON object: ``{"vllm": <the imported package's file and version>, "results": {line: verdict}}``.

The names are checked by importing them (not by reading the files with ``ast``): a signature is
what ``inspect`` sees after decorators, inherited methods and dataclass machinery, which a parse
cannot give. The 0.33/0.34 sources import under this repository's venvs (torch 2.13 CPU, no
Triton) although those wheels pin torch 2.14: vLLM imports Triton through a placeholder, and
nothing imported here needs the compiled ``_C`` library. Only ``instance attr`` entries are read
from the class's source (``self.X = ...`` in its body or a base's), since an instance attribute
exists only once an instance is built.

A verdict is ``ok``, ``absent`` (the name does not exist) or ``wrong: <what was found>``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

NAMES = Path(__file__).with_name("mrv2_names.txt")


def entries() -> list[tuple[str, str, tuple[str, ...]]]:
    """``(name, what, versions)`` of every line of the names file."""
    found = []
    for line in NAMES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, what, versions = line.split("\t")
        found.append((name, what, tuple(versions.split())))
    return found


def _resolve(name: str) -> tuple[Any, Any, str]:
    """``(owner, obj, attr)`` for ``module:qualname`` (owner is None for a module attribute path)."""
    module_name, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    owner: Any = None
    parts = qualname.split(".")
    for part in parts:
        owner = obj
        if isinstance(obj, type):
            obj = inspect.getattr_static(obj, part, _MISSING)
            if obj is _MISSING:
                obj = getattr(owner, part, _MISSING)
        else:
            obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return owner, _MISSING, part
    return owner, obj, parts[-1]


_MISSING = object()


def _parameters(signature_text: str) -> list[tuple[str, bool]]:
    """``(name, has_default)`` of each parameter of a signature as the names file writes it."""
    source = f"def f{signature_text.split(' -> ')[0] if ' -> ' in signature_text else signature_text}: pass"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        # Shortened annotations may not parse: fall back to the names and defaults by text.
        inner = signature_text[signature_text.index("(") + 1 : signature_text.rindex(")")]
        return [(p.split(":")[0].split("=")[0].strip(), "=" in p) for p in _split(inner) if p.strip()]
    args = tree.body[0].args  # type: ignore[attr-defined]
    found: list[tuple[str, bool]] = []
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    found += [(a.arg, d) for a, d in zip(positional, defaults, strict=True)]
    if args.vararg:
        found.append(("*" + args.vararg.arg, False))
    found += [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        found.append(("**" + args.kwarg.arg, False))
    return found


def _split(text: str) -> list[str]:
    depth, parts, current = 0, [], ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _actual_parameters(obj: Any) -> list[tuple[str, bool]]:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    signature = inspect.signature(obj)
    found = []
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        name = parameter.name
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            name = "*" + name
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            name = "**" + name
        found.append((name, parameter.default is not inspect.Parameter.empty))
    return found


def _fields(cls: Any) -> set[str]:
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "_fields", ()) or ())
    names |= set(getattr(cls, "__annotations__", {}) or {})
    names |= set(getattr(cls, "model_fields", {}) or {})
    return names


def _instance_attrs(cls: type) -> set[str]:
    """Every ``self.X`` a class (or a base) assigns or annotates in its body."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
        names |= _fields(klass)
    return names


def verdict(name: str, what: str) -> str:
    try:
        owner, obj, attr = _resolve(name)
    except ImportError as exc:
        return f"absent: {exc}"
    if what == "instance attr":
        cls = owner if isinstance(owner, type) else None
        if cls is None:
            return f"wrong: {name.split(':')[1].rsplit('.', 1)[0]} is not a class"
        if inspect.getattr_static(cls, attr, _MISSING) is not _MISSING:
            return "ok"  # a class attribute or property reads the same from an instance
        return "ok" if attr in _instance_attrs(cls) else "absent"
    if what == "field":
        if isinstance(owner, type) and attr in _fields(owner):
            return "ok"
        return "absent"
    if obj is _MISSING:
        return "absent"
    if what.startswith("("):
        try:
            actual = _actual_parameters(obj)
        except (TypeError, ValueError) as exc:
            return f"wrong: no signature ({exc})"
        expected = _parameters(what)
        return "ok" if actual == expected else f"wrong: parameters {actual} != {expected}"
    if what == "class":
        return "ok" if isinstance(obj, type) else f"wrong: {type(obj).__name__}"
    if what == "property":
        return "ok" if isinstance(obj, property) else f"wrong: {type(obj).__name__}"
    if what == "tuple":
        return "ok" if isinstance(obj, tuple) else f"wrong: {type(obj).__name__}"
    if what in ("value", "module attr"):
        return "ok"
    return "ok" if type(obj).__name__ == what else f"wrong: a {type(obj).__name__}"


def omnigen_on_this_vllm() -> dict[str, Any]:
    """What omnigen's runtime and generated modules do on these sources: both targets of every
    stage import; the target ``runner_target`` picks for a config where vLLM chose V2 (or has no
    V1); and, where vLLM has no V1 runner, building a V1 runner fails with vLLM's reason."""
    repo = Path(__file__).resolve().parents[2]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    found: dict[str, Any] = {"imported": [], "errors": {}}
    try:
        from omnigen import paths, pipeline
        from omnigen.runtime import scheduler, vllm_api, worker  # noqa: F401
    except Exception as exc:
        found["errors"]["omnigen.runtime"] = f"{type(exc).__name__}: {exc}"
        return found
    for model in paths.model_names():
        for stage in pipeline.model_plan(model).stages:
            for module in (stage.module, stage.v2_module):
                try:
                    importlib.import_module(module)
                    found["imported"].append(module)
                except Exception as exc:
                    found["errors"][module] = f"{type(exc).__name__}: {exc}"

    class _ChoseV2:
        use_v2_model_runner = True

    found["v1_runner_available"] = vllm_api.v1_runner_available()
    found["missing_seams"] = list(vllm_api.v2_missing_seams())
    try:
        found["target_where_vllm_chose_v2"] = vllm_api.runner_target(_ChoseV2()).target
    except RuntimeError as exc:
        found["target_where_vllm_chose_v2"] = f"refused: {exc}"
    try:
        vllm_api.GPUModelRunner(None, None)
    except RuntimeError as exc:
        found["v1_runner_built"] = f"refused: {exc}"
    except Exception as exc:  # vLLM's own V1 runner, failing on the dummy arguments
        found["v1_runner_built"] = f"vllm's V1 runner ({type(exc).__name__})"
    return found


def main() -> None:
    version, sources = sys.argv[1], Path(sys.argv[2]).resolve()
    import vllm

    where = Path(vllm.__file__).resolve()
    results = {}
    for name, what, _versions in entries():
        key = f"{name}\t{what}"
        try:
            results[key] = verdict(name, what)
        except Exception as exc:  # a broken import of one module is that name's verdict
            results[key] = f"absent: {type(exc).__name__}: {exc}"
    json.dump(
        {
            "version": version,
            "vllm_file": str(where),
            "from_sources": sources in where.parents,
            "vllm_version": getattr(vllm, "__version__", None),
            "results": results,
            "omnigen": omnigen_on_this_vllm(),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
