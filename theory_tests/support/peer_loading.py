"""Load peers' MARS implementations for the differential tests in ``theory_tests/peers``.

``pytorch_optimizer`` (4.1.0) imports cleanly (numpy and torch only): ``import`` it directly.
timm's does not: ``load_timm_mars`` below.
"""
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["load_timm_mars", "TIMM_VERSION"]

TIMM_VERSION = "1.0.31"  # the version whose Mars the convention map was written against


def load_timm_mars():
    """timm's ``Mars`` optimizer class, loaded from ``timm/optim/_types.py`` and
    ``timm/optim/mars.py`` of the installed timm, without running ``timm/__init__.py``.

    Why not ``from timm.optim import Mars``: timm's package ``__init__`` imports its model zoo,
    which imports torchvision; torchvision is not a dependency of this project and must not
    become one (it pins torch to one build, and CI installs timm with ``--no-deps`` for this
    reason).  The two files we need import only ``torch``, ``typing`` and each other
    (``mars.py`` does ``from ._types import ParamsT``), so they are executed as modules
    ``timm.optim._types`` and ``timm.optim.mars`` under stub ``timm`` and ``timm.optim``
    package modules (``types.ModuleType`` with the installed folders as ``__path__``), made
    only for the load: the relative import resolves through them.  The stubs and the two
    modules are taken out of ``sys.modules`` afterwards (names that were there before are
    restored), so a later ``import timm`` elsewhere in the process is not handed a stub; the
    loaded module keeps its own globals, which is all ``Mars`` needs.

    The installed version must be ``TIMM_VERSION`` (the map in ``peer_conventions`` is checked
    against that file); another version raises ``RuntimeError`` rather than comparing against
    code the map was not written for.  A missing timm raises ``ModuleNotFoundError``: CI installs
    it (``pip install --no-deps timm==1.0.31``), and the peer tests are not skipped without it.
    """
    from importlib.metadata import version

    installed = version("timm")
    if installed != TIMM_VERSION:
        raise RuntimeError(f"timm {installed} is installed; the MARS convention map was written "
                           f"against timm {TIMM_VERSION} (pip install --no-deps "
                           f"timm=={TIMM_VERSION})")
    spec = importlib.util.find_spec("timm")  # a top-level find_spec runs no package code
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("timm is not installed (pip install --no-deps timm==1.0.31)")
    root = Path(list(spec.submodule_search_locations)[0])
    names = ("timm", "timm.optim", "timm.optim._types", "timm.optim.mars")
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    try:
        for name, folder in (("timm", root), ("timm.optim", root / "optim")):
            stub = types.ModuleType(name, f"stub package for loading {folder} without __init__")
            stub.__path__ = [str(folder)]
            stub.__package__ = name
            sys.modules[name] = stub
        for name in ("timm.optim._types", "timm.optim.mars"):
            path = root / "optim" / (name.rsplit(".", 1)[1] + ".py")
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        return sys.modules["timm.optim.mars"].Mars
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
