"""Package layout: conf/, templates/ and generated/ ship inside the ``omnigen`` package.

They live at the top of the checkout (where people edit and review them) and are mapped
to ``omnigen.conf``, ``omnigen.templates`` and ``omnigen.generated`` in the wheel; the
generated runners import as ``omnigen.generated.<model>.<stage>`` from either. testing/ is the
separate top-level package ``omnigen_testing`` (test support: the tiny models ``omnigen run
model=omnigen_tiny`` serves, checkpoint writers, the oracle harnesses); ``omnigen`` never imports it.
"""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
MAPPED = {"omnigen.conf": "conf", "omnigen.templates": "templates", "omnigen.generated": "generated"}


def _subpackages(prefix: str, folder: Path) -> list[str]:
    found = [prefix]
    for sub in sorted(p for p in folder.rglob("*") if p.is_dir()):
        parts = sub.relative_to(folder).parts
        if any(part.startswith((".", "__")) for part in parts):
            continue  # caches (.ruff_cache, __pycache__) are not packages
        found.append(prefix + "." + ".".join(parts))
    return found


packages = _subpackages("omnigen", HERE / "omnigen")
for prefix, folder in MAPPED.items():
    packages += _subpackages(prefix, HERE / folder)
packages += _subpackages("omnigen_testing", HERE / "testing")

setup(
    packages=packages,
    package_dir={"omnigen": "omnigen", **MAPPED, "omnigen_testing": "testing"},
    package_data={
        "omnigen": ["ruff.toml"],
        "omnigen.conf": ["*.yaml", "**/*.yaml"],
        "omnigen.templates": ["*.j2"],
        "omnigen.generated": ["**/*.yaml", "omnigen-manifest.txt"],
    },
    include_package_data=False,
)
