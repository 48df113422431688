"""Run a command and fail if its process tree ever holds more memory than allowed.

    python tools/peak_memory.py --limit-gib 4 -- python -m pytest --nbval-lax notebooks

The course promises that every notebook runs within 4 GiB of RAM. Notebooks run one
after another under nbval, so the peak of the whole run is the largest notebook's
peak. The tree's resident set sizes are summed (pytest, the kernel and the ranks it
spawns); pages the processes share are counted once per process, so the figure is an
upper bound on what the machine needed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def tree_rss(root: psutil.Process) -> int:
    """Bytes resident in ``root`` and all its descendants right now."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:  # a rank that just exited
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, required=True, help="largest allowed peak, in GiB")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    child = subprocess.Popen(command)
    root, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_rss(root))
        except psutil.Error:
            pass
        time.sleep(args.interval)
    verdict = "within" if peak <= args.limit_gib * 2**30 else "OVER"
    print(f"peak memory of the run: {peak / 2**30:.2f} GiB, {verdict} the {args.limit_gib:g} GiB limit")
    if child.returncode:
        return child.returncode
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    sys.exit(main())
