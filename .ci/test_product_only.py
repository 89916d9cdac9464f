"""The repository describes the product, not how the team builds it (nox -s lint).

Every text file git tracks (and every new file git would track) is searched for the vocabulary
of the team's internal process: issue and pull-request numbers, the labels of measurement runs,
the paths and scripts by which build machines carry wheels to GPU machines, and notes about a
working session's machine time. A hit fails naming file:line; say it in product terms instead
(a measured number belongs in docs/performance.md with its command, machine and date).

    pytest .ci/test_product_only.py
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()

# (what it is, pattern). Each is narrow enough that product text does not match it.
PATTERNS = [
    ("an issue number", re.compile(r"\bissues? #?\d+\b", re.I)),
    ("an issue or PR reference", re.compile(r"(?<![\w&/#'\"])#\d+\b")),
    ("a run label", re.compile(r"\bafter-\d+\b")),
    ("a run label", re.compile(r"\brun\d+\b")),
    ("a run label", re.compile(r"\bH[12]00 run\b")),
    ("a run folder", re.compile(r"\bh[12]00-\d+\b")),
    ("a build-machine path", re.compile(r"(?<![\w.])\.gpu/")),
    ("the build machines' wheel kit", re.compile(r"\bGPU kit\b|\bthe kit\b", re.I)),
    ("a session's machine time", re.compile(r"\bdevice (?:time|tool|budget)\b", re.I)),
    ("a session note", re.compile(r"\bnext lease\b|\bsession notes?\b", re.I)),
    ("a build-machine call", re.compile(r"\bcarry=")),
    ("a build-machine script", re.compile(r"\bstash\.sh\b|\bwait10\b|\bgo\d+[a-z]*\b")),
    ("the team's shared folder", re.compile(r"\.\./shared/")),
]


def tracked_files() -> list[Path]:
    """Files git tracks, and untracked ones it would (not ignored), that exist on disk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in out.decode().split("\0") if name]
    return [p for p in paths if p.is_file() and p.resolve() != SELF]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None  # binary
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(text: str) -> list[tuple[int, str, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in PATTERNS:
            match = pattern.search(line)
            if match:
                found.append((number, what, match.group(0)))
    return found


@pytest.mark.parametrize(
    "line",
    [
        "see issues 12 and 14",
        "Issue #19 warns of it",
        "fixed in #20",
        "measured in after-\x38 on one H100",  # escaped: the tree itself stays free of the label
        "H200 run7 gave 0.99x",
        "(run5)",
        "raw files in benchmarks/results/h100-3/",
        "carry .gpu/extra with the call",
        "after the GPU kit's install call",
        "no device budget left",
        'call(carry=[".gpu/part7"], ...)',
        "bash .gpu/bin/stash.sh 7",
        "driver go12ab.sh there",
        "the next lease re-measures it",
        "from ../shared/gpu's train set",
    ],
)
def test_each_pattern_catches_what_it_is_for(line):
    assert hits(line), line


@pytest.mark.parametrize(
    "line",
    [
        "the run directory: runs/<run name>/",
        "a request kept across a refit runs under the new weights",
        "a session id in the URL path; this session's trace",
        "the GPU image's toolkit",
        "pass@1 after 20 steps, on one H100 80GB",
        "refit 43-62 ms on an H200; run it with --steps 8",
        "color: #ffffff; &#39; page#12",
        "git diff HEAD -- docs/",
    ],
)
def test_product_text_passes(line):
    assert not hits(line), hits(line)


def test_no_file_names_the_internal_process():
    found = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        for number, what, match in hits(text):
            found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {match!r}")
    assert not found, "internal process named (say it in product terms):\n" + "\n".join(found)
