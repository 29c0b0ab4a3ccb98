"""Read py-spy's collapsed stacks (`py-spy record --format raw`, as `run.sh profile` writes them): where
the sampled time went, per process, by function.

    python benchmarks/gpu/collapsed.py prof_c1.txt                 # each process: top self and total
    python benchmarks/gpu/collapsed.py prof_c1.txt --process spawn  # only processes whose line has 'spawn'
    python benchmarks/gpu/collapsed.py prof_c1.txt --under execute_model --top 30

A line is `frame;frame;...;frame COUNT`, the root first; with `--subprocesses` the first frames name the
process (`process PID:"cmdline"`). `--under NAME` keeps the samples whose stack passes through a frame
containing NAME and shows the frames below it. Totals are percentages of the samples kept.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_FILE_LINE = re.compile(r" \(([^:()]+):\d+\)$")


def frame_name(frame: str) -> str:
    """`func (path/file.py:123)` -> `func (file.py)`: one name per function, whatever the line."""
    match = _FILE_LINE.search(frame)
    if not match:
        return frame
    return f"{frame[:match.start()]} ({match.group(1).rsplit('/', 1)[-1]})"


def read_stacks(path: str) -> list[tuple[str, list[str], int]]:
    """(process, frames below the process frames, count) per line."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            procs = [fr for fr in frames if fr.startswith("process ")]
            rest = [frame_name(fr) for fr in frames if not fr.startswith("process ")]
            process = procs[-1][:90] if procs else "(one process)"
            rows.append((process, rest, int(count)))
    return rows


def summarize(rows, top: int) -> None:
    by_process: dict[str, list] = defaultdict(list)
    for process, frames, count in rows:
        by_process[process].append((frames, count))
    for process, stacks in sorted(by_process.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        total = sum(c for _, c in stacks)
        self_time, inclusive = Counter(), Counter()
        for frames, count in stacks:
            if frames:
                self_time[frames[-1]] += count
            for name in set(frames):
                inclusive[name] += count
        print(f"\n== {process}: {total} samples")
        print("-- self")
        for name, count in self_time.most_common(top):
            print(f"{100 * count / total:6.1f}%  {name}")
        print("-- total (inclusive)")
        for name, count in inclusive.most_common(top):
            print(f"{100 * count / total:6.1f}%  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--process", default="", help="keep processes whose frame contains this text")
    parser.add_argument("--under", default="", help="keep samples through a frame containing this text")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = [r for r in read_stacks(args.path) if args.process in r[0]]
    if args.under:
        kept = []
        for process, frames, count in rows:
            hits = [i for i, fr in enumerate(frames) if args.under in fr]
            if hits:
                kept.append((process, frames[hits[0]:], count))
        rows = kept
    summarize(rows, args.top)


if __name__ == "__main__":
    main()
