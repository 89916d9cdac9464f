"""Run model-written Python in a child process with limits: wall time, memory, output size, no
network, a fresh working directory per call. Asynchronous, so a slow program never stalls the
runner's event loop (the other rollouts of the process keep going).

No network: by default the child runs in a new network namespace (`unshare --net
--map-root-user`): the kernel gives it no interface but its own loopback, for it and for every
process it starts. Where the kernel refuses unprivileged user namespaces (some CI containers,
Ubuntu's AppArmor default), an audit hook in the child refuses socket creation and starting
processes instead: it stops code that reaches for the network by mistake, not code written to
escape (ctypes can), so prefer a machine where the namespace works. `Sandbox().isolation` says
which one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs first in the child (python -I: no user site, no PYTHON* variables, no current directory
# on the path): limits, the audit hook when asked, then the program as __main__, its traceback
# without this code's frame.
BOOTSTRAP = """
import resource, sys, traceback
memory, cpu_s, file_bytes, audit = map(int, sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if audit:
    BLOCKED = {"socket.__new__", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
               "os.spawn", "os.fork", "os.forkpty"}
    def refuse(event, args):
        if event in BLOCKED:
            raise PermissionError(f"{event}: no network or new processes in this sandbox")
    sys.addaudithook(refuse)
sys.argv = ["main.py"]
try:
    code = compile(open("main.py", encoding="utf-8").read(), "main.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as error:
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
"""

# What the child may see of the environment: nothing of the runner's (no tokens, no keys).
CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per math library: many sandboxes run at once on the runner's few cores.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock; the child and everything it started are then killed
    memory_mb: int = 1024  # address space (RLIMIT_AS): an allocation beyond it fails
    max_output_bytes: int = 4096  # stdout and stderr together: its first and last halves kept
    max_file_mb: int = 64  # the largest file the program may write


@dataclass
class Execution:
    output: str  # stdout and stderr, interleaved as written; a line in the middle says what was cut
    status: str  # "ok", "error" (nonzero exit: an exception), "timeout" or "crashed" (a signal)
    exit_code: int | None  # None on timeout; -N when signal N ended it
    cut_bytes: int  # output left out in the middle (0: all of it is there)
    seconds: float


class CappedOutput:
    """The first and last `limit / 2` bytes of a stream fed in chunks: a long output's start
    and its end (where a traceback's error line is), and how much was cut between."""

    def __init__(self, limit: int):
        self.half, self.head, self.tail, self.cut = limit // 2, bytearray(), bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        room = max(self.half - len(self.head), 0)
        self.head += chunk[:room]
        tail = self.tail + chunk[room:]
        over = max(len(tail) - self.half, 0)  # pushed out of the tail: cut
        self.tail, self.cut = tail[over:], self.cut + over

    def text(self) -> str:
        middle = f"\n[... {self.cut} bytes cut ...]\n" if self.cut else ""
        return self.head.decode(errors="replace") + middle + self.tail.decode(errors="replace")


@functools.cache
def namespace_works() -> bool:
    """Whether `unshare` can give a child its own network namespace here (checked once)."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--net", "--map-root-user", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Sandbox:
    def __init__(self, limits: Limits = Limits(), isolation: str = "auto", parallel: int = 0):
        """`isolation`: "namespace", "audit", or "auto" (the namespace where the kernel allows).
        `parallel`: programs running at once (0: one per CPU); later calls wait their turn."""
        if isolation == "auto":
            isolation = "namespace" if namespace_works() else "audit"
        if isolation not in ("namespace", "audit"):
            raise ValueError(f"isolation must be 'auto', 'namespace' or 'audit', not {isolation!r}")
        self.limits, self.isolation = limits, isolation
        self.slots = asyncio.Semaphore(parallel or os.cpu_count() or 1)

    def command(self) -> list[str]:
        limits = self.limits
        numbers = [
            limits.memory_mb << 20,
            int(limits.timeout_s) + 1,  # CPU seconds: a backstop behind the wall clock
            limits.max_file_mb << 20,
            int(self.isolation == "audit"),
        ]
        # -I ignores PYTHON* variables, so: -u (stdout and stderr interleaved as written, as in
        # a terminal), -B (no bytecode files), -X utf8.
        python = [sys.executable, "-I", "-u", "-B", "-X", "utf8", "-c", BOOTSTRAP]
        python += [str(n) for n in numbers]
        if self.isolation == "namespace":
            return ["unshare", "--net", "--map-root-user", "--", *python]
        return python

    async def run(self, code: str) -> Execution:
        """Run `code` as a program in a fresh temporary directory, removed afterwards."""
        async with self.slots:
            workdir = tempfile.mkdtemp(prefix="molt-sandbox-")
            try:
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                    f.write(code)
                return await self._execute(workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    async def _execute(self, workdir: str) -> Execution:
        start, output = time.monotonic(), CappedOutput(self.limits.max_output_bytes)
        process = await asyncio.create_subprocess_exec(
            *self.command(),
            cwd=workdir,
            env=CHILD_ENV | {"HOME": workdir, "TMPDIR": workdir},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: one kill ends all it started
        )
        # Done when the program has exited and the pipe is closed: a process it left running
        # with the pipe open keeps the call going until the time is up.
        finished = asyncio.gather(read_to_end(process.stdout, output), process.wait())
        try:
            _, code = await asyncio.wait_for(finished, self.limits.timeout_s)
            status = "ok" if code == 0 else "error" if code > 0 else "crashed"
        except TimeoutError:  # what it wrote until then is kept
            code, status = None, "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever the group left, on every exit
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        seconds = time.monotonic() - start
        return Execution(output.text(), status, code, output.cut, seconds)


async def read_to_end(stream: asyncio.StreamReader, output: CappedOutput) -> None:
    while chunk := await stream.read(1 << 16):
        output.feed(chunk)
