"""Fail if installing one package pulled in anything outside its allowed dependencies.

Usage: python .ci/check_isolation.py PACKAGE ALLOWED [ALLOWED ...]

Run in a fresh environment right after `pip install ./packages/PACKAGE` (no extras). Every
installed distribution must be PACKAGE itself, the installer's own tooling, or in the
dependency closure of the allowed top-level names. A sibling that declared, say, ray or fastapi
would bring distributions outside that closure and fail here.
"""

import re
import sys
from importlib import metadata

TOOLING = {"pip", "setuptools", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = [canonical(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            # Requirements behind an extra are not installed by a plain install; other markers
            # are kept (over-approximating the closure only makes the check more lenient).
            if re.search(r";.*\bextra\s*==", line):
                continue
            stack.append(canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group()))
    return seen


def main() -> int:
    package, allowed = sys.argv[1], sys.argv[2:]
    installed = {canonical(d.metadata["Name"]) for d in metadata.distributions()}
    expected = closure(allowed) | {canonical(package)} | TOOLING
    extra = sorted(installed - expected)
    if extra:
        print(f"{package} pulled in distributions beyond {allowed}: {extra}")
        return 1
    print(
        f"{package}: {len(installed)} distributions installed, all within {allowed} (+ their deps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
