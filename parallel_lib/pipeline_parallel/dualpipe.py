"""DualPipeV: DeepSeek's DualPipe folded into a V, in the course's schedule format.

DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1) feeds micro-batches
into both ends of the pipeline at once and runs the forward of one micro-batch *overlapped* with
the backward of another ("F&B" chunks), so the all-to-all of expert parallelism in one hides
behind the computation of the other. It keeps two copies of the parameters. Folding the
pipeline into a V (Sea AI Lab's "cut-in-half" DualPipeV, the order ``torch.distributed.pipelining``'s
``ScheduleDualPipeV`` builds) gives each of p ranks the model stages r and 2p-1-r, like ZB-V,
and one copy of the parameters.

Rank r's list, for ``m >= 2p`` micro-batches (``c0 = r``, ``c1 = 2p-1-r``):

1. ``2(p-r-1)`` forwards on c0, then ``r+1`` pairs F(c0), F(c1);
2. ``p-r-1`` times: B(c1) with its W put off, the oldest put-off W, F(c1) (zero-bubble style);
3. the main phase, ``m-2p+r+1`` times: F(c0) & backward(c1), then F(c1) & backward(c0);
4. ``p-r-1`` times: backward(c1), then F(c1) & backward(c0);
5. ``r+1`` times backward(c1), backward(c0); half-way through, the backwards turn split (W put off);
6. ``p-r-1`` times: the oldest put-off W, backward(c0); then the remaining put-off W.

How it fits the format (F, B, W actions, one at a time per rank):

- a *whole* backward (DualPipe runs most of them unsplit) is ``B`` immediately followed by its ``W``:
  the same arithmetic, and the gradient the previous stage waits for leaves after B instead of
  after B + W, which can only start it earlier;
- an overlapped ``F&B`` chunk is its F then its backward, one after the other. The overlap itself
  does not fit: it needs an action that runs two micro-batches at once on one rank (two CUDA
  streams, or a fused forward-backward step as DeepSeek's kernels do), and a simulator cost for
  the pair (``F&B`` < F + B once communication hides behind compute). On one CPU thread per rank,
  with no expert all-to-all to hide, the pair costs F + B anyway, so nothing measurable is lost here.
"""

from __future__ import annotations

from parallel_lib.pipeline_parallel.schedule import Action, Schedule, _check_sizes, register_schedule, v_placement

__all__ = ["dualpipev", "check_dualpipev_m"]


def check_dualpipev_m(p: int, m: int) -> None:
    """DualPipeV's requirement: ``m >= 2p`` (its main phase runs ``m-2p+r+1 >= 1`` times on rank 0)."""
    _check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs m, the number of micro-batches, at least 2p={2 * p} (the model "
                         f"stages of the V), got m={m}; use m={2 * p}")


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV for p ranks and m micro-batches (see the module docstring).

    Raises:
        ValueError: p or m below 1, or m < 2p.
    """
    check_dualpipev_m(p, m)
    ranks = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        nxt = {("F", c0): 0, ("F", c1): 0, ("B", c0): 0, ("B", c1): 0}  # next micro-batch per kind and stage
        put_off: list[Action] = []  # weight gradients waiting, oldest first
        actions: list[Action] = []
        split = False  # whether backwards leave their W for later (from half-way through step 5 on)

        def add(kind: str, s: int, defer: bool = False) -> None:
            i = nxt[(kind, s)]
            nxt[(kind, s)] += 1
            actions.append(Action(kind, i, s))  # type: ignore[arg-type]
            if kind == "B":
                (put_off.append if defer else actions.append)(Action("W", i, s))

        def oldest_w() -> None:
            if put_off:
                actions.append(put_off.pop(0))

        for _ in range(2 * (p - r - 1)):
            add("F", c0)
        for _ in range(r + 1):
            add("F", c0)
            add("F", c1)
        for _ in range(p - r - 1):
            add("B", c1, defer=True)
            oldest_w()
            add("F", c1)
        for _ in range(m - 2 * p + r + 1):
            add("F", c0)  # overlapped with the next backward in DualPipe (module docstring)
            add("B", c1)
            add("F", c1)
            add("B", c0)
        for _ in range(p - r - 1):
            add("B", c1)
            add("F", c1)
            add("B", c0)
        for k in range(r + 1):
            # the switch to split backwards comes half-way, before c1's B on odd ranks, after it on even ones
            split = split or (k == (r + 1) // 2 and r % 2 == 1)
            add("B", c1, defer=split)
            split = split or (k == (r + 1) // 2 and r % 2 == 0)
            add("B", c0, defer=split)
        for _ in range(p - r - 1):
            oldest_w()
            add("B", c0, defer=split)
        while put_off:
            oldest_w()
        ranks.append(tuple(actions))
    return Schedule("dualpipev", p, m, tuple(ranks), v_placement(p))


register_schedule("dualpipev", dualpipev, virtual=2)
