"""Run a command and fail if its process tree ever holds more memory than allowed.

    python tools/peak_memory.py --limit-gib 4 -- python -m pytest --nbval-lax notebooks

The course promises that every notebook runs within 4 GiB of RAM. Notebooks run one
after another under nbval, so the peak of the whole run is the largest notebook's
peak. The tree's memory is summed over pytest, the kernel and the ranks it starts, as
proportional set sizes where Linux reports them (``Pss`` in ``/proc/PID/smaps_rollup``):
a page shared by k processes counts 1/k in each. Ranks forked from one fork server
share torch's pages, so summing resident set sizes would count those pages once per
rank and report far more than the machine needed; that upper bound is printed beside it.
Elsewhere the resident set sizes are summed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def _pss(pid: int) -> int | None:
    """Proportional set size of ``pid`` in bytes (None where the kernel does not report it)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """``(proportional, resident)`` bytes of ``root`` and all its descendants right now."""
    proportional = resident = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss = proc.memory_info().rss
        except psutil.Error:  # a rank that just exited
            continue
        pss = _pss(proc.pid)
        resident += rss
        proportional += rss if pss is None else pss
    return proportional, resident


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
    root, peak, peak_resident = psutil.Process(child.pid), 0, 0
    while child.poll() is None:
        try:
            proportional, resident = tree_memory(root)
            peak, peak_resident = max(peak, proportional), max(peak_resident, resident)
        except psutil.Error:
            pass
        time.sleep(args.interval)
    verdict = "within" if peak <= args.limit_gib * 2**30 else "OVER"
    print(f"peak memory of the run: {peak / 2**30:.2f} GiB, {verdict} the {args.limit_gib:g} GiB limit "
          f"(shared pages counted once; {peak_resident / 2**30:.2f} GiB counting them in every process)")
    if child.returncode:
        return child.returncode
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    sys.exit(main())
