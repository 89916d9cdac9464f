"""CPU seconds of every process a quickstart start-up launches, up to its end.

    RAY_AUTH_MODE=disabled python benchmarks/quickstart_startup_cpu.py [-- extra molt-train flags]

Runs benchmarks/quickstart_startup.py (2 steps) and samples every process started after it,
every 0.5 s: prints each one's CPU seconds, its first and last sighting (seconds since launch)
and the total (docs/benchmarks.md, issue 13).
"""

import subprocess
import sys
import time
from pathlib import Path

import psutil


def main() -> None:
    t0 = time.time()
    script = Path(__file__).with_name("quickstart_startup.py")
    run = subprocess.Popen([sys.executable, str(script), *sys.argv[1:]])
    seen: dict[int, dict] = {}
    while run.poll() is None:
        for p in psutil.process_iter(["cmdline", "cpu_times", "create_time"]):
            info = p.info
            if info["create_time"] is None or info["create_time"] < t0 - 1:
                continue  # not this run's
            cpu = info["cpu_times"].user + info["cpu_times"].system
            row = seen.setdefault(p.pid, {"first": time.time() - t0})
            row.update(cpu=cpu, last=time.time() - t0,
                       cmd=" ".join(info["cmdline"] or []).replace("\n", " ")[:100])  # fmt: skip
        time.sleep(0.5)
    rows = sorted(seen.values(), key=lambda r: -r["cpu"])
    for r in rows[:20]:
        print(f"{r['cpu']:6.1f} CPU s  {r['first']:5.1f} -> {r['last']:5.1f} s  {r['cmd']}")
    print(f"all processes: {sum(r['cpu'] for r in rows):.1f} CPU s")


if __name__ == "__main__":
    main()
