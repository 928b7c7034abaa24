"""Test-only stub of ``torchvision``.

Why it exists: SGLang imports torchvision while it loads (its vision-model configs), and the
registry's torchvision build is a CUDA one that does not load beside the CPU torch. The test ring
serves a text-only Llama, which never calls into torchvision. Every ``torchvision.*`` module
imports here, and every name in it is a placeholder that raises when it is called, so an import
succeeds and any real use fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+tpcache.stub"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{qualname} comes from the test-only torchvision stub and cannot be used")

    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__new__": refuse, "__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_Finder())
sys.modules[__name__].__class__ = _StubModule  # the package itself answers any name with a placeholder
