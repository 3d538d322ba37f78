"""Stands in for ``torch._dynamo`` (torch.compile's compiler) in the test jobs whose workers
neither compile nor use Lightning (runner.run_ranks puts this folder on their PYTHONPATH).

Eager torch imports torch._dynamo at an optimizer's first ``add_param_group`` and ``step`` only
to call ``disable(fn)`` (which then just calls ``fn``) and ``graph_break()`` (nothing outside a
compiled region); the import brings in sympy and torch.distributed, about 1.7 s of CPU per
rank on 2 cores, a fifth of the torch tests' CPU. Here both are what they do in eager mode;
any other name raises, naming this file, so a worker that needs the real compiler fails
loudly (name ``torch.compile`` or ``lightning`` in its source and it gets the real one).
"""
import importlib.abc
import importlib.machinery
import sys

_NAME = "torch._dynamo"


def disable(fn=None, recursive=True, *, reason=None, wrapping=True):
    """``fn`` itself: what dynamo's ``disable`` does when nothing is compiled."""
    return fn if fn is not None else (lambda later: later)


def graph_break() -> None:
    """Nothing: there is no graph to break outside torch.compile."""


def _missing(name: str):
    raise AttributeError(f"{_NAME}.{name} is not in the stand-in that "
                         f"tests/parallel/without_dynamo/sitecustomize.py gives this job; a "
                         f"worker that compiles names torch.compile in its source")


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch._dynamo`` before torch's own package does."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == _NAME else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.disable, module.graph_break, module.__getattr__ = disable, graph_break, _missing


sys.meta_path.insert(0, _StandIn())
