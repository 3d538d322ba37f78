"""Names of a package that load their module on first use: the estimators' packages, whose
ranks import only the training function (``remote``) and must not pay for pyspark.ml."""
from typing import Any, Callable, List, Sequence, Tuple

__all__ = ["lazy_names"]


def lazy_names(package: str, module: str, names: Sequence[str]
               ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` that take ``names`` from ``module``."""
    def getattr_(name: str) -> Any:
        if name in names:
            import importlib
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> List[str]:
        import sys
        return sorted([*vars(sys.modules[package]), *names])
    return getattr_, dir_
