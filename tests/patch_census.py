"""A census of what trainguard has written into other packages: shared by tests/test_close.py,
tests/test_transparency.py and their workers (tests/comm_hook_worker.py,
tests/transparency_worker.py), which take it before a Guard, while it is open and after
``close()``.

It does not list what trainguard is known to patch: it looks. Every module loaded in the process
that is not trainguard's, the script's or a test's (torch, the standard library, every installed
package), every attribute of it and of each class it defines, is checked for a function whose
code lies in trainguard's package (a wrapper made with ``functools.wraps`` included: its code is
trainguard's whatever name it copies) or an object of a trainguard class. Besides attributes:
``os.environ``'s class, and with a DDP ``model`` an attribute set on the instance and a
communication hook of trainguard's that DDP still calls.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Optional

import trainguard

PACKAGE = str(Path(trainguard.__file__).resolve().parent) + os.sep
REPO = str(Path(__file__).resolve().parents[1]) + os.sep
PREFIX = os.path.realpath(sys.prefix) + os.sep


def _ours(value: Any) -> bool:
    """Whether ``value`` is trainguard's: a function (or bound method, or a class's function)
    whose code is in trainguard's package, or an instance of one of its classes."""
    fn = value.__func__ if isinstance(value, (types.MethodType, classmethod, staticmethod)) else value
    if isinstance(fn, types.FunctionType):  # no getattr on other objects: some compute attributes on access
        return fn.__code__.co_filename.startswith(PACKAGE)
    if isinstance(value, (type, types.ModuleType)):
        return False
    return str(type(value).__module__).partition(".")[0] == "trainguard"


def _foreign(name: str, module: types.ModuleType) -> bool:
    """A module that is neither trainguard's nor the script's nor a test's."""
    if name == "__main__" or name.partition(".")[0] == "trainguard":
        return False
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    return not path.startswith(REPO) or path.startswith(PREFIX)  # the repository's venv is foreign


def replaced(model: Optional[Any] = None) -> list[str]:
    """What of trainguard's is in other packages now, as ``module.attribute`` or
    ``module.Class.attribute`` (sorted): empty in a process without a Guard, or after ``close()``."""
    with warnings.catch_warnings():  # reading a deprecated alias (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        return _census(model)


def _census(model: Optional[Any]) -> list[str]:
    out = set()
    for name, module in list(sys.modules.items()):
        if module is None or not _foreign(name, module):
            continue
        try:
            members = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in members:
            if _ours(value):
                out.add(f"{name}.{attr}")
            elif isinstance(value, type) and value.__module__ == name:
                out.update(f"{name}.{value.__qualname__}.{a}" for a, v in list(vars(value).items()) if _ours(v))
    if type(os.environ).__module__.partition(".")[0] == "trainguard":
        out.add("os.environ's class")
    if model is not None:
        out.update(f"{type(model).__name__}.{a} (on the instance)" for a, v in vars(model).items() if _ours(v))
        out.update(f"{type(model).__name__}: a communication hook of trainguard's" for h in _hooks(model) if _ours(h))
    return sorted(out)


def _hooks(model: Any) -> list[Any]:
    """The communication hooks DDP calls for ``model`` (none for another module)."""
    from trainguard import compat

    hooks = compat.ddp_comm_hooks(model) if hasattr(model, "reducer") else None
    return [h for h, _ in hooks or []]
