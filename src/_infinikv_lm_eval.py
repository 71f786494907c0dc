"""Makes ``lm_eval --model infinikv`` work: registers infinikv's lm-eval model when lm-eval loads
its own models.

``infinikv_lm_eval.pth`` (written beside the package by ``setup.py``) imports this at
interpreter start-up, so it must stay tiny and import nothing heavy: it only watches for
``lm_eval.models`` and, once that module has registered lm-eval's models, adds ``infinikv`` as a
lazy entry
(``infinikv.harness:InfinikvLM``), so programs that never use lm-eval never import infinikv or
torch because of it.
"""

import importlib.abc
import importlib.machinery
import sys

WATCHED = "lm_eval.models"
TARGET = "infinikv.harness:InfinikvLM"


class _RegisterAfter(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)  # resources, is_package, ...: lm-eval's own loader answers

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        from lm_eval.api.registry import model_registry

        if "infinikv" not in model_registry:
            model_registry.register("infinikv", target=TARGET)


class _Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


if not any(isinstance(f, _Watch) for f in sys.meta_path):
    sys.meta_path.insert(0, _Watch())
