"""Where conf/, templates/ and generated/ are: a checkout's folders, else the installed package's."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


def _is_checkout() -> bool:
    return (_CHECKOUT / "conf" / "config.yaml").is_file() and (_CHECKOUT / "templates").is_dir()


def conf_dir() -> Path:
    return _CHECKOUT / "conf" if _is_checkout() else _PACKAGE / "conf"


def templates_dir() -> Path:
    return _CHECKOUT / "templates" if _is_checkout() else _PACKAGE / "templates"


def generated_dir() -> Path:
    """The tree ``omnigen.generated`` imports from."""
    return _CHECKOUT / "generated" if _is_checkout() else _PACKAGE / "generated"


def model_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
