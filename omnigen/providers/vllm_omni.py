"""vllm-omni as a model provider: its model classes, without its package patching vLLM.

``import vllm_omni`` runs ``vllm_omni/__init__.py``, whose ``patch.py`` swaps vLLM's ``Request``,
``EngineCoreRequest``, ``EngineCoreOutput(s)``, ``TokensPrompt``, ``MRotaryEmbedding`` and
``StreamingUpdate`` in every loaded ``vllm*`` module. omnigen's runners run on plain vLLM, so a
process that serves vllm-omni's classes gets a bare ``vllm_omni`` package module instead: its
submodules import from the installed folder, ``__init__.py`` never runs (tests/e2e/test_models.py
checks that a served pipeline's processes keep vLLM's own ``Request``).

What else its model modules need that omnigen's processes do not otherwise have:

- ``torchaudio`` and ``torchvision`` are imported at module level (Qwen3-TTS's prompt builder,
  Qwen3-Omni's image processor) but used only on some requests (reference audio, images). Where
  one is not installed, a guard module stands in: importing works, any use raises
  ``MissingOptionalDependency`` naming the package, so a request that needs it fails with that
  message and every other request runs.
- On a platform vllm-omni does not know (CPU), its ``supports_torch_inductor()`` raises; the
  shared code predictor asks it on its first call. Without inductor the answer is False.
- On a torch build without CUDA, ``torch.cuda.is_current_stream_capturing()`` raises
  (``RuntimeError: Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing``, torch
  2.13's CPU build) instead of answering; Higgs Audio v3's code2wav asks it before every decode
  (``higgs_audio_v3_code2wav.py`` ``_validate_codes``). Such a build has no streams to capture:
  the answer is False, as vLLM answers it for XPU (``xpu_model_runner.py`` maps it to torch.xpu's).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

DISTRIBUTION = "vllm-omni"
OPTIONAL_MODULES = (
    "torchaudio",
    "torchaudio.functional",
    "torchaudio.transforms",
    "torchaudio.compliance",
    "torchaudio.compliance.kaldi",
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.transforms.functional",
    "torchvision.io",
    "torchvision.ops",
)


class MissingOptionalDependency(RuntimeError):
    """A vllm-omni code path needs a package that is not installed here."""


class ProviderPatchedVllm(RuntimeError):
    """vllm-omni's package (and its patch of vLLM) was already imported in this process."""


class _Guarded:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Guarded(f"{self._name}.{name}")

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        package = self._name.split(".")[0]
        raise MissingOptionalDependency(
            f"{self._name}: {package} is not installed; this request needs it (install the "
            f"{package} build that matches your torch)"
        )

    def __repr__(self) -> str:
        return f"<not installed: {self._name}>"


class _GuardModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Guarded(f"{self.__name__}.{name}")


def guarded_modules() -> list[str]:
    """The optional modules this process has guards for (not installed)."""
    return sorted(name for name, mod in sys.modules.items() if isinstance(mod, _GuardModule))


def module_installed(name: str) -> bool:
    """Whether ``name`` is really installed (a guard standing in for it is not)."""
    if isinstance(sys.modules.get(name.split(".")[0]), _GuardModule):
        return False
    return importlib.util.find_spec(name) is not None


def is_bare() -> bool:
    module = sys.modules.get("vllm_omni")
    return module is not None and getattr(module, "__omnigen_bare__", False)


def vllm_patched() -> bool:
    """True when vllm-omni's ``patch.py`` has swapped vLLM's request class in this process."""
    from vllm.v1.request import Request

    return Request.__module__.startswith("vllm_omni")


def prepare() -> None:
    """Make vllm-omni's model modules importable in this process without its ``__init__``."""
    install_optional_guards()
    install_bare_package()


def after_import() -> None:
    """What the imported classes need from vllm-omni's platform layer (see the module docstring)."""
    from vllm_omni.platforms import current_omni_platform
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    if isinstance(current_omni_platform, UnspecifiedOmniPlatform):
        UnspecifiedOmniPlatform.supports_torch_inductor = classmethod(lambda cls: False)  # type: ignore[method-assign]
    import torch

    if not torch.backends.cuda.is_built():
        torch.cuda.is_current_stream_capturing = _no_stream_capturing


def _no_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing`` of a torch build without CUDA."""
    return False


def install_bare_package() -> None:
    """A bare ``vllm_omni`` package module (its submodules import, its ``__init__`` never runs)."""
    existing = sys.modules.get("vllm_omni")
    if existing is not None:
        if getattr(existing, "__omnigen_bare__", False):
            return
        raise ProviderPatchedVllm(
            "vllm_omni was imported as a package in this process, so its patch.py has replaced "
            "vLLM's request classes; omnigen serves vllm-omni's models on plain vLLM. Start "
            "omnigen's engines with VLLM_PLUGINS=omnigen (omnigen run/serve do) and do not "
            "import vllm_omni yourself"
        )
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm_omni")
    module = types.ModuleType("vllm_omni")
    module.__path__ = list(spec.submodule_search_locations)
    module.__file__ = spec.origin
    module.__spec__ = importlib.machinery.ModuleSpec("vllm_omni", None, is_package=True)
    module.__spec__.submodule_search_locations = module.__path__
    module.__omnigen_bare__ = True  # type: ignore[attr-defined]
    sys.modules["vllm_omni"] = module


def install_optional_guards() -> None:
    """Guards for the optional modules that are not installed (see the module docstring)."""
    # transformers records at import which optional packages exist: let it see this
    # environment's truth before a guard exists, or it takes them for installed.
    import transformers.utils.import_utils  # noqa: F401

    missing_roots: set[str] = set()
    for name in OPTIONAL_MODULES:
        root = name.split(".")[0]
        if name in sys.modules:
            continue
        if root not in missing_roots and importlib.util.find_spec(root) is not None:
            continue
        missing_roots.add(root)
        module = _GuardModule(name)
        module.__path__ = []  # a package: its submodules resolve to guards too
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
