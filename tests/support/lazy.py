"""A module imported on first use, for test files whose heavy import only their own tests need.

Under ``pytest -n 3 --dist loadfile`` every xdist worker imports every test file to collect it, while one worker
runs it: Keras's import (about 2.5 CPU s, with scikit-learn, pandas and matplotlib behind it) was paid three times
for one file's tests. The stand-in imports the module at the first attribute a test reads; a package that is not
installed skips the file at collection, as ``pytest.importorskip`` does.

Example:
    >>> json = module("json")       # nothing imported yet
    >>> json.dumps([1])             # imported here
    '[1]'
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest


class _Deferred(ModuleType):
    """Reads every public attribute from the real module, importing it the first time (a name starting with ``_``,
    ``__version__`` included, is not read through: pytest's collection probes module globals for such names)."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's collection probes each module global for its markers: no import there
            raise AttributeError(attr)
        return getattr(importlib.import_module(self.__name__), attr)


def module(name: str) -> ModuleType:
    """A stand-in for ``name`` that imports it at its first attribute access; skips the calling file if absent."""
    if name in sys.modules:
        return sys.modules[name]
    if importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(f"could not import {name!r}", allow_module_level=True)
    return _Deferred(name)
