"""molt_examples.sandbox's limits, each run for real in a child process: wall time (the child and
what it started are killed), memory, output size, no network (both isolations), a fresh working
directory removed afterwards, a crash, an environment without the runner's secrets."""

import asyncio
import os
import socket
import time

import pytest

from molt_examples.sandbox import CappedOutput, Limits, Sandbox, namespace_works

ISOLATIONS = [
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(
            not namespace_works(), reason="the kernel refuses unprivileged user namespaces"
        ),
    ),
    "audit",
]


def run(code: str, isolation: str = "audit", **limits):
    return asyncio.run(Sandbox(Limits(**limits), isolation=isolation).run(code))


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_program_runs_and_its_output_comes_back(isolation):
    result = run("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)", isolation)
    assert result.status == "ok" and result.exit_code == 0
    assert result.output == "42\nto stderr\n" and result.cut_bytes == 0


def test_an_exception_is_the_programs_output_without_the_sandbox_frames():
    result = run("def f():\n    return 1 / 0\nf()")
    assert result.status == "error" and result.exit_code == 1
    assert 'File "main.py", line 2, in f' in result.output
    assert result.output.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.output  # the bootstrap's own frame is left out


def test_a_runaway_program_and_what_it_started_are_killed_at_the_time_limit(tmp_path):
    pid_file = tmp_path / "pid"
    code = (  # a grandchild in the same process group, then a busy loop
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "while True: pass\n"
    )
    start = time.monotonic()
    # 5 s: the program prints within a fraction of a second even on a loaded machine.
    result = run(code, "namespace" if namespace_works() else "audit", timeout_s=5.0)
    if not namespace_works():  # the audit hook refuses to start processes: still a clean error
        assert result.status == "error" and "subprocess.Popen" in result.output
        return
    assert result.status == "timeout" and result.exit_code is None
    assert 5.0 <= time.monotonic() - start < 60.0  # killed at the limit, not waited on
    assert result.output == "started\n"  # what it wrote before the limit is kept
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        time.sleep(0.05)  # killed with the group; its parent reaps nothing, init does
    assert not os.path.exists(f"/proc/{grandchild}") or zombie(grandchild)


def zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_memory_beyond_the_limit_fails_the_allocation():
    result = run("x = bytearray(512 << 20)\nprint('allocated')", memory_mb=256)
    assert result.status == "error" and "MemoryError" in result.output
    assert "allocated" not in result.output
    assert run("x = bytearray(64 << 20)\nprint('allocated')", memory_mb=256).status == "ok"


def test_output_beyond_the_cap_keeps_its_start_and_its_end():
    result = run("print('x' * 100_000)\nprint('done')", max_output_bytes=1000)
    assert result.status == "ok" and result.cut_bytes == 100_006 - 1000
    cut = "\n[... 99006 bytes cut ...]\n"
    assert result.output == "x" * 500 + cut + "x" * 494 + "\ndone\n"
    assert run("print('x' * 999)", max_output_bytes=1000).cut_bytes == 0  # 1000 bytes: all kept


def test_capped_output_fed_in_any_chunks():
    for size in (1, 3, 7, 64):
        output, data = CappedOutput(10), bytes(range(40))
        for i in range(0, len(data), size):
            output.feed(data[i : i + size])
        assert (output.head, output.tail, output.cut) == (data[:5], data[-5:], 30)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_no_network_not_even_the_hosts_loopback(isolation):
    """A server this test listens on, on the host's loopback: unreachable from the program, by
    itself or through a process it starts."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        direct = run(connect + "\nprint('connected')", isolation)
        assert direct.status == "error" and "connected" not in direct.output
        spawned = run(
            "import subprocess, sys\n"
            f"out = subprocess.run([sys.executable, '-c', {connect!r}], capture_output=True)\n"
            "print('exit', out.returncode)",
            isolation,
        )
    if isolation == "namespace":  # the kernel refuses: the new process has no route either
        assert direct.output.rstrip().endswith(("Connection refused", "Network is unreachable"))
        assert spawned.status == "ok" and spawned.output == "exit 1\n"
    else:  # the audit hook refuses the socket, and starting the process
        assert "socket.__new__" in direct.output
        assert spawned.status == "error" and "subprocess.Popen" in spawned.output


def test_each_call_gets_a_fresh_directory_removed_afterwards():
    code = "import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    first, second = run(code), run(code)
    first_dir, listing = first.output.splitlines()
    assert listing == "['left.txt', 'main.py']" and second.output.splitlines()[1] == listing
    assert first_dir != second.output.splitlines()[0]
    assert not os.path.exists(first_dir)  # removed, with what the program wrote
    timed_out = run("import os\nprint(os.getcwd(), flush=True)\nwhile True: pass", timeout_s=1.0)
    assert timed_out.status == "timeout" and not os.path.exists(timed_out.output.strip())


def test_a_crash_is_reported_with_its_signal():
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.status == "crashed" and result.exit_code == -11


def test_the_program_sees_none_of_the_runners_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret")
    result = run("import os\nprint(sorted(os.environ))")
    assert "HF_TOKEN" not in result.output and "HOME" in result.output


def test_calls_beyond_the_parallel_limit_wait_their_turn():
    sandbox = Sandbox(Limits(), isolation="audit", parallel=2)

    async def three() -> float:
        start = time.monotonic()
        await asyncio.gather(*(sandbox.run("import time; time.sleep(1)") for _ in range(3)))
        return time.monotonic() - start

    assert asyncio.run(three()) >= 2.0  # two at once, then the third


def test_an_unknown_isolation_is_refused():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="none")
