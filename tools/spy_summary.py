"""Summarize a py-spy ``record -f raw --threads`` profile: one thread's samples by function,
inclusive (the function is on the stack) and by line (the innermost frame).

    python3 -m tools.spy_summary PROFILE.raw [--thread enginecore-step] [--within EngineCore.step]
        [--top 40]

``--thread``: a part of the thread's name (py-spy's first frame, ``thread (tid): name``);
``--within``: keep only the samples whose stack holds a frame containing it (e.g. one
function's, to split its time). With py-spy's ``--gil`` the samples are those taken while the
thread held the GIL (what a constrained step's host time is made of: the step thread's and the event
loop's Python share it).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_LINE = re.compile(r":\d+\)$")


def summarize(lines, thread: str, within: str = "") -> tuple[int, collections.Counter,
                                                            collections.Counter]:
    """(samples kept, inclusive samples by function, samples by innermost line)."""
    inclusive: collections.Counter = collections.Counter()
    by_line: collections.Counter = collections.Counter()
    total = 0
    for raw in lines:
        stack, _, count = raw.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if thread not in frames[0] or (within and not any(within in f for f in frames[1:])):
            continue
        n = int(count)
        total += n
        for name in {_LINE.sub(")", f) for f in frames[1:]}:
            inclusive[name] += n
        by_line[frames[-1]] += n
    return total, inclusive, by_line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--thread", default="enginecore-step")
    ap.add_argument("--within", default="")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    with open(a.profile) as f:
        total, inclusive, by_line = summarize(f, a.thread, a.within)
    print(f"{total} samples of thread {a.thread!r}" + (f" within {a.within!r}" if a.within else ""))
    if not total:
        return 1
    for title, counts in (("inclusive, by function", inclusive), ("innermost line", by_line)):
        print(f"--- {title}")
        for name, n in counts.most_common(a.top):
            print(f"{n:7d} {100 * n / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
