"""Package names that load on first use (PEP 562), for the packages' `__init__` modules: a
process that imports one submodule (a Ray actor, an engine's supervisor) pays for it alone."""

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, list[str]]):
    """`__getattr__`, `__dir__`, `__all__` for `package`, re-exporting `exports` (module: names)."""
    module_of = {name: module for module, names in exports.items() for name in names}
    namespace = vars(sys.modules[package])  # the package itself, still being initialised

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # Stored in the package: the next lookup is a plain attribute.
        value = namespace[name] = getattr(importlib.import_module(module_of[name]), name)
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *module_of])

    return __getattr__, __dir__, sorted(module_of)
