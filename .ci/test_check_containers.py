"""check_containers.py passes on the repository and fails on each kind of drift (nox -s lint).

Every case copies the files the check reads into a temporary tree, changes one thing the way a
careless edit would, and expects the error that names it.
"""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import check_containers  # noqa: E402

ROOT = check_containers.ROOT


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel in ("noxfile.py", "containers", "constraints"):
        source = ROOT / rel
        if source.is_dir():
            shutil.copytree(source, tmp_path / rel)
        else:
            shutil.copy(source, tmp_path / rel)
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        package = tmp_path / pyproject.parent.relative_to(ROOT)
        (package / "src").mkdir(parents=True)  # noxfile.implemented() looks for src/
        shutil.copy(pyproject, package / "pyproject.toml")
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new, 1))


def errors_of(root: Path) -> str:
    return "\n".join(check_containers.check(root))


def test_repository_passes():
    assert check_containers.check(ROOT) == []


def test_copy_passes(tree):
    assert check_containers.check(tree) == []


CPU = "containers/Dockerfile.cpu"
GPU = "containers/Dockerfile.gpu"
UNINSTALL = "pip uninstall -y torchvision torchaudio torchcodec"

# (file, text, replacement, what the errors must say): one careless edit each.
DRIFT = {
    "cpu image, gpu constraints": (
        CPU,
        "-c constraints/cpu.txt torch",
        "-c constraints/gpu.txt torch",
        ["nox uses [constraints/cpu.txt]"],
    ),
    "cpu image, no constraints": (
        CPU,
        "pip install -c constraints/cpu.txt torch",
        "pip install torch",
        ["constraints []"],
    ),
    "cpu image, other torch": (
        CPU,
        "cpu.txt torch\n",
        "cpu.txt torch==2.12.0\n",
        ["extra ['torch==2.12.0']", "missing ['torch']"],
    ),
    "cpu image, a package left out": (
        CPU,
        "./packages/molt-capture ",
        "",
        ["missing ['packages/molt-capture']", "does not install ['packages/molt-capture']"],
    ),
    "cpu image, other extras": (
        CPU,
        '"./packages/molt-train[cpu]"',
        '"./packages/molt-train[cpu,test]"',
        ["extra ['packages/molt-train[cpu,test]']"],
    ),
    "cpu image, shorter uninstall list": (
        CPU,
        "torchaudio torchcodec",
        "torchaudio",
        ["nox uninstalls ['torchaudio', 'torchcodec', 'torchvision']"],
    ),
    "nox, longer uninstall list": (
        "noxfile.py",
        '"torchaudio", "torchcodec"]',
        '"torchaudio", "torchcodec", "pillow"]',
        ["nox uninstalls ['pillow', 'torchaudio', 'torchcodec', 'torchvision']"],
    ),
    "nox, quickstart with other extras": (
        "noxfile.py",
        'install_package(session, "molt-train", "cpu")',
        'install_package(session, "molt-train", "cpu,test")',
        ["missing ['packages/molt-train[cpu,test]']"],
    ),
    "nox, an install without constraints": (
        "noxfile.py",
        "    install(session, TORCH)\n    for package in PACKAGES:",
        "    session.install(TORCH)\n    for package in PACKAGES:",
        ["session.install outside install()", "nox -s all: constraints []"],
    ),
    "nox, other constraints file": (
        "noxfile.py",
        'CONSTRAINTS = ROOT / "constraints" / "cpu.txt"',
        'CONSTRAINTS = ROOT / "constraints" / "gpu.txt"',
        ["constraints ['constraints/gpu.txt'], not [constraints/cpu.txt]"],
    ),
    "gpu image, cpu extra": (
        GPU,
        '"./packages/molt-train[cuda]"',
        '"./packages/molt-train[cpu]"',
        ["missing ['packages/molt-train[cuda]']"],
    ),
    "gpu image, cpu constraints": (
        GPU,
        "uv pip install -c constraints/gpu.txt --override constraints/gpu-overrides.txt torch",
        "uv pip install -c constraints/cpu.txt torch",
        ["constraints ['constraints/cpu.txt'], not [constraints/gpu.txt]"],
    ),
    "gpu pin outside a package's range": (
        "constraints/gpu.txt",
        "vllm==0.26.0",
        "vllm==0.25.0",
        ["pins vllm==0.25.0, but packages/molt-rollout/pyproject.toml [cuda] asks vllm>=0.26"],
    ),
    "loose pin": (
        "constraints/common.txt",
        "ray==2.60.0",
        "ray>=2.60",
        ["ray>=2.60: pin an exact version"],
    ),
    "pin in two places": (
        "constraints/cpu.txt",
        "torch==2.13.0+cpu\n",
        "torch==2.13.0+cpu\nray==2.60.0\n",
        ["ray is pinned already in constraints/common.txt"],
    ),
    "cpu constraints, CUDA torch": (
        "constraints/cpu.txt",
        "torch==2.13.0+cpu",
        "torch==2.13.0",
        ["not the +cpu build"],
    ),
}


@pytest.mark.parametrize("case", DRIFT)
def test_drift_is_named(tree, case):
    rel, old, new, expected = DRIFT[case]
    edit(tree / rel, old, new)
    errors = check_containers.check(tree)
    assert all(any(e in error for error in errors) for e in expected), errors
    assert bool(errors) == bool(expected), errors


def test_uninstall_before_the_cpu_extra(tree):
    edit(tree / CPU, "\n    && " + UNINSTALL, "")
    edit(tree / CPU, "cpu.txt torch\n", "cpu.txt torch && " + UNINSTALL + "\n")
    assert "installs a [cpu] extra after the last uninstall" in errors_of(tree)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("COPY constraints/ constraints/", "COPY recipes/ recipes/", "is not under any COPY"),
        ("pip install -c constraints/cpu.txt torch", "pip install --target /x torch", "--target"),
    ],
)
def test_unreadable_dockerfile(tree, old, new, message):
    edit(tree / CPU, old, new)
    with pytest.raises(ValueError, match=message):
        check_containers.check(tree)
