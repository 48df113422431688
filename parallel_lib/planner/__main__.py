"""``python -m parallel_lib.planner calibrate | show | published | dry-run``: calibration, published runs, dry run.

- ``calibrate [--refresh] [--world-sizes 2 4]``: measure (a few seconds per world size, more on a busy
  machine) and cache under ``~/.cache/parallel_lib`` (``$PARALLEL_LIB_CACHE``); print the numbers.
- ``show``: print the cached calibration (measuring it first if there is none).

Bad world sizes are a usage error before anything runs; a damaged cache or an unwritable cache folder
ends with one line naming the file or folder and what to do (exit status 1), before any measurement.
- ``published``: the published training runs beside the planner's layouts (takes a minute or two).
- ``dry-run [--world-sizes 8 64 256 1024] [--tp 1 8]``: GPT-2 XL and Llama 3 8B and 70B split by PyTorch's
  DTensor tensor parallelism and FSDP2 over a fake process group, rank 0's parameters beside the
  planner's (:mod:`parallel_lib.planner.dry_run`; half a minute).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from parallel_lib.common import tables
from parallel_lib.planner.calibrate import Calibration, check_world_sizes
from parallel_lib.planner.calibration_cache import cache_path, load_or_calibrate


def describe(calibration: Calibration) -> str:
    """A table per world size: compute rates, model step costs and each collective's α and β."""
    rows = []
    for n, speed in sorted(calibration.ranks.items()):
        steps = "; ".join(f"{key}: {fixed * 1e3:.2f} ms/block + {rate / 1e9:.1f} GFLOP/s, forward {share:.0%}"
                          for key, (fixed, rate, _, share) in speed.step_costs.items())
        links = "; ".join(f"{kind} α {ab.alpha * 1e6:.0f} µs, β {ab.bandwidth / 1e9:.2f} GB/s"
                          for kind, ab in speed.links.items()) or "—"
        links += "".join(f"; {kind} in tp pairs inside a step α {ab.alpha * 1e6:.0f} µs, β {ab.bandwidth / 1e9:.2f} GB/s"
                         for kind, ab in speed.inside.items())
        rows.append([n, f"{speed.flops_per_second / 1e9:.1f}", f"{speed.bytes_per_second / 1e9:.1f}", steps, links])
    return (f"Calibration of {calibration.machine}\n\n" +
            tables.markdown_table(["ranks", "matmul GFLOP/s per rank", "copy GB/s per rank", "model step",
                                   "collectives (α per ring step, β bytes/s sent)"], rows))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.planner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure this machine and cache the result")
    cal.add_argument("--refresh", action="store_true", help="measure again even if a cached calibration exists")
    cal.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    sub.add_parser("show", help="print the cached calibration")
    sub.add_parser("published", help="published training runs beside the planner")
    dry = sub.add_parser("dry-run", help="PyTorch's FSDP2 and DTensor shards at 8 to 1,024 ranks beside the planner")
    dry.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    dry.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    if args.command == "dry-run":
        from parallel_lib.planner.dry_run import DRY_RUN_HEADER, DRY_RUN_MODELS, dry_run, dry_run_rows

        try:
            runs = dry_run(DRY_RUN_MODELS, args.world_sizes, args.tp)
        except ValueError as error:
            parser.error(f"dry-run: {error}")
        print(tables.markdown_table(DRY_RUN_HEADER, dry_run_rows(runs), "lrlrrrrr"))
        return 0
    if args.command == "published":
        from parallel_lib.planner.published import compare_all, table

        print(tables.markdown_table(["run", "GPUs", "their layout", "their GiB/GPU (predicted)", "planner's layout",
                                     "its GiB/GPU", "why they differ", "source"], table(compare_all())))
        return 0
    refresh = args.command == "calibrate" and args.refresh
    kwargs = {}
    if args.command == "calibrate":
        try:
            kwargs = dict(world_sizes=check_world_sizes(args.world_sizes))
        except ValueError as error:
            parser.error(f"--world-sizes: {error}")
    try:
        calibration = load_or_calibrate(refresh=refresh, **kwargs)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(describe(calibration))
    print(f"\ncached in {cache_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
