"""Where conf/, templates/ and generated/ are: a checkout's folders, else the installed package's.

Models and group options come from a search path: omnigen's own ``conf/``, then the folders given
with ``-cd DIR`` or listed in ``OMNIGEN_CONFIG_PATH`` (separated like ``PATH``), in the order Hydra
searches them (``-cd`` comes after the primary config's folder, so a shipped name wins). Each folder holds ``model/NAME.yaml`` (and optionally ``serve/``,
``device/``, ``graph/`` options).
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent
CONFIG_PATH_ENV = "OMNIGEN_CONFIG_PATH"

_extra_config_dirs: list[Path] = []


def _is_checkout() -> bool:
    return (_CHECKOUT / "conf" / "config.yaml").is_file() and (_CHECKOUT / "templates").is_dir()


def is_installed() -> bool:
    """omnigen runs from an installed wheel (its generated/ is inside site-packages)."""
    return not _is_checkout()


def conf_dir() -> Path:
    return _CHECKOUT / "conf" if _is_checkout() else _PACKAGE / "conf"


def templates_dir() -> Path:
    return _CHECKOUT / "templates" if _is_checkout() else _PACKAGE / "templates"


def generated_dir() -> Path:
    """The tree ``omnigen.generated`` imports from."""
    return _CHECKOUT / "generated" if _is_checkout() else _PACKAGE / "generated"


def set_extra_config_dirs(dirs: list[Path]) -> None:
    """The user's config folders (``-cd DIR``), searched after omnigen's ``conf/``."""
    _extra_config_dirs[:] = [Path(d).resolve() for d in dirs]


def extra_config_dirs() -> list[Path]:
    from_env = [Path(p).resolve() for p in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if p]
    seen: list[Path] = []
    for d in [*_extra_config_dirs, *from_env]:
        if d not in seen and d != conf_dir().resolve():
            seen.append(d)
    return seen


def config_dirs() -> list[Path]:
    """The search path, first match wins: omnigen's conf/, then the user's folders."""
    return [conf_dir(), *extra_config_dirs()]


def group_options(group: str) -> list[str]:
    return sorted({p.stem for d in config_dirs() for p in (d / group).glob("*.yaml")})


def model_names() -> list[str]:
    """Every model on the search path."""
    return group_options("model")


def shipped_model_names() -> list[str]:
    """The models of omnigen's own conf/ (the committed ``generated/`` tree holds exactly these)."""
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def model_file(name: str) -> Path:
    """The file ``model=name`` reads: the first on the search path (omnigen's conf/ if none)."""
    for d in config_dirs():
        path = d / "model" / f"{name}.yaml"
        if path.is_file():
            return path
    return conf_dir() / "model" / f"{name}.yaml"


def is_shipped_model(name: str) -> bool:
    return model_file(name).parent.parent == conf_dir()


def shown(path: Path) -> str:
    """A path as messages show it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(path)
