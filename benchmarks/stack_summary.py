"""Where a process spent its time, from py-spy's collapsed stacks (`py-spy record -f raw`).

    python benchmarks/stack_summary.py DIR_OR_FILE... [--top 30]

For each file: the number of samples, then the frames with the most samples at the top of the
stack (self time) and the frames with the most samples anywhere in the stack (inclusive time,
each frame counted once per sample), as shares of all samples. py-spy leaves idle threads out,
so the shares are of the time some thread of the process was running Python or native code.
"""

import argparse
from collections import Counter
from pathlib import Path


def summarise(path: Path, top: int) -> str:
    self_time, inclusive, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        self_time[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"== {path.name}: {total} samples"]
    for title, counts in (("self", self_time), ("inclusive", inclusive)):
        lines.append(f"-- {title}")
        lines += [f"{n / max(total, 1):6.1%}  {frame}" for frame, n in counts.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    files = [f for p in args.paths for f in (sorted(p.glob("*.txt")) if p.is_dir() else [p])]
    print("\n\n".join(summarise(f, args.top) for f in files))


if __name__ == "__main__":
    main()
