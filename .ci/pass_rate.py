"""A test's pass rate: run chosen tests N times, half of them with every core kept busy.

    python .ci/pass_rate.py TEST [TEST ...] [--runs 20] [--loaded 10] [--out DIR]
    nox -s pass_rate -- TEST [TEST ...] --runs 20         # the same in a fresh environment

Each run is a fresh `pytest` process (a learning test's engines, Ray and process groups start
anew, as in CI). A loaded run starts one busy-looping process per core first, the way another
heavy job shares a CI machine. A test exposes the quantity it asserts on with pytest's
`record_property(name, value)`; the table shows each quantity's range over the runs, which is
what a threshold is derived from (docs/development.md, "Tests that never flake").
"""

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def spin() -> None:
    while True:
        pass


def run_once(tests: list[str], report: Path, loaded: bool) -> None:
    """One pytest process over `tests`, its results in the junit file `report`."""
    load = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for process in load if loaded else []:
        process.start()
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
        subprocess.run([*command, f"--junitxml={report}"], stdout=subprocess.DEVNULL, check=False)
    finally:
        for process in load if loaded else []:
            process.kill()
            process.join()


def outcomes(report: Path) -> dict[str, tuple[str, float, dict[str, float]]]:
    """test id -> (outcome, seconds, recorded properties) from one junit file; prints the
    message of each failure."""
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        if outcome in ("failure", "error"):
            print(f"  {name}: {(kinds[outcome].get('message') or '')[:300]}")
        properties = {
            p.get("name"): float(p.get("value")) for p in case.iter("property") if p.get("value")
        }
        found[name] = (outcome, float(case.get("time", 0)), properties)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--loaded", type=int, help="how many runs under load (default: half)")
    parser.add_argument("--out", type=Path, help="keep each run's junit file here")
    args = parser.parse_args()
    loaded = args.runs // 2 if args.loaded is None else args.loaded
    out = args.out or Path(tempfile.mkdtemp(prefix="pass_rate-"))
    out.mkdir(parents=True, exist_ok=True)
    results = defaultdict(list)  # test -> [(loaded, outcome, seconds, properties)]
    for run in range(args.runs):
        under_load = (run * loaded) // args.runs != ((run + 1) * loaded) // args.runs  # spread
        report = out / f"run{run:03d}.xml"
        started = time.monotonic()
        run_once(args.tests, report, under_load)
        if not report.exists():
            print(f"run {run}: pytest wrote no report (collection failed?)", file=sys.stderr)
            return 1
        for test, (outcome, seconds, properties) in outcomes(report).items():
            results[test].append((under_load, outcome, seconds, properties))
        failed = [t for t, rows in results.items() if rows[-1][1] in ("failure", "error")]
        state = f"{len(failed)} failed" if failed else "all passed"
        load = "loaded" if under_load else "idle"
        print(f"run {run + 1}/{args.runs} ({load}, {time.monotonic() - started:.0f} s): {state}")
    print(f"\njunit files in {out}")
    for test, rows in results.items():
        ran = [r for r in rows if r[1] != "skipped"]
        passed = [r for r in ran if r[1] == "passed"]
        passed_loaded = sum(1 for r in passed if r[0])
        seconds = [r[2] for r in ran] or [0.0]
        print(f"\n{test}")
        print(
            f"  passed {len(passed)}/{len(ran)} ({passed_loaded}/{sum(1 for r in ran if r[0])} "
            f"under load); {min(seconds):.1f}-{max(seconds):.1f} s, median "
            f"{statistics.median(seconds):.1f} s"
        )
        names = sorted({name for r in ran for name in r[3]})
        for name in names:
            values = [r[3][name] for r in ran if name in r[3]]
            print(f"  {name}: {min(values):.4g} .. {max(values):.4g} over {len(values)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
