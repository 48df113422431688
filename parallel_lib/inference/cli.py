"""``python -m parallel_lib.inference``: serve a few prompts with one strategy, launched here or by torchrun.

Every :class:`~parallel_lib.inference.strategies.ServeConfig` field is a flag. Rank 0 prints each
request's tokens, time to first token and time per output token, then each rank's or device's
KV-cache and weight bytes (and, for tp, its all-reduces per step beside the formula 2 · layers);
``--check`` also runs the single engine and compares the tokens::

    python -m parallel_lib.inference --strategy pp --world-size 2 --prompts "1 2 3" "4 5 6 7" --check
    torchrun --standalone --nproc-per-node 2 -m parallel_lib.inference --strategy tp
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Optional

import torch

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.common.cli import add_config_flags
from parallel_lib.inference.batch import Request
from parallel_lib.inference.strategies import IN_PROCESS, STRATEGIES, ServeConfig, check_serve, serve
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun

__all__ = ["main", "parse_prompt"]

DEFAULT_PROMPTS = ("1 2 3 4 5", "7 8", "9 10 11 12 13 14 15 16", "3")


def parse_prompt(text: str) -> tuple[int, ...]:
    """``"1 2 3"`` or ``"1,2,3"`` as token ids.

    Raises:
        argparse.ArgumentTypeError: a word that is not an int.
    """
    try:
        return tuple(int(word) for word in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a prompt is token ids separated by spaces or commas, got {text!r}") from None


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the flags, serve (here or under torchrun), print rank 0's summary; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.inference", description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="single")
    parser.add_argument("--world-size", type=int, default=None, help="ranks or devices (default 1 for single, "
                        "else 2; under torchrun its --nproc-per-node x --nnodes)")
    parser.add_argument("--prompts", type=parse_prompt, nargs="+", default=[parse_prompt(p) for p in DEFAULT_PROMPTS],
                        help='token ids of each prompt, e.g. --prompts "1 2 3" "4 5"')
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--eos", type=int, default=None, help="stop a request after this token")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the run and each wait")
    parser.add_argument("--check", action="store_true", help="also run the single engine and compare the tokens")
    add_config_flags(parser, ServeConfig)
    args = vars(parser.parse_args(argv))
    strategy, check = args.pop("strategy"), args.pop("check")
    if is_torchrun() and strategy in IN_PROCESS:
        parser.error(f"--strategy {strategy} runs in one process; start it with python -m, not torchrun")
    world_size = args.pop("world_size")  # None: the default; 0 is refused below, not replaced
    if world_size is None:
        world_size = RankInfo.from_env().world_size if is_torchrun() else 1 if strategy == "single" else 2
    launch = dict(threads_per_rank=args.pop("threads_per_rank"), timeout=args.pop("timeout"))
    prompts, common = args.pop("prompts"), dict(max_new_tokens=args.pop("max_new_tokens"),
                                               temperature=args.pop("temperature"), eos=args.pop("eos"))
    config = replace(ServeConfig(), **args)
    try:  # here, before any rank starts
        positive_number("timeout", launch["timeout"], hint="seconds for the run and each wait")
        if launch["threads_per_rank"] is not None:
            positive_int("threads_per_rank", launch["threads_per_rank"])
        requests = [Request(p, seed=i, **common) for i, p in enumerate(prompts)]
        check_serve(strategy, world_size, requests, config)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if strategy in IN_PROCESS and launch["threads_per_rank"]:  # launched ranks set their own
        torch.set_num_threads(launch["threads_per_rank"])
    run = serve(requests, strategy, world_size, config, **launch)
    if is_torchrun() and RankInfo.from_env().rank != 0:
        return 0
    print(f"{strategy} on {run.world_size} {'device(s)' if strategy in IN_PROCESS else 'rank(s)'}, {machine_label()}: "
          + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
    for r in run.results:
        timing = f"first token {r.ttft * 1e3:7.1f} ms, then {r.tpot * 1e3:6.2f} ms/token" if r.ok else r.error
        print(f"  request {r.index}: {r.tokens}  {timing}")
    print(f"  {run.tokens_per_second():,.1f} tokens/s over {run.seconds:.3f} s")
    n_layer = config.config().n_layer
    for rank in run.ranks:
        line = (f"  {rank.lane:<9} KV cache {rank.kv_bytes / 2**20:8.3f} MiB, "
                f"weights {rank.weight_bytes / 2**20:8.3f} MiB")
        decode = {calls for step, calls, _ in rank.collectives if step > 0}
        if decode:
            line += f", all-reduces per decode step {sorted(decode)} (formula 2 x {n_layer} layers = {2 * n_layer})"
        print(line)
    if check:
        reference = serve(requests, "single", 1, config)
        if reference.tokens != run.tokens:
            print("  MISMATCH: the tokens differ from the single engine's:", reference.tokens)
            return 1
        print("  same tokens as the single engine")
    return 0
