"""Checkpoints of a sharded run: one file per rank, and the way to and from a plain model.

A ZeRO rank holds only its shard of each flat group, so it saves only that
(:func:`shard_state`, :func:`save_shards`): parameters (the fp32 master under bf16),
AdamW's two moments and its step count, plus the layout needed to put the pieces back.

- :func:`consolidate` joins the shards of every rank into a plain ``model.state_dict()``
  and a plain ``torch.optim.AdamW`` state dict (parameters in ``model.parameters()`` order);
- :func:`load_full` goes the other way: every rank cuts its shard out of plain state dicts.

Through the plain form a run can continue on any number of ranks. :func:`load_shards`
reloads a rank's own file directly, which only makes sense with the same world size,
stage and grouping; anything else is a ``ValueError`` that says to consolidate first.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["shard_state", "save_shards", "load_shards", "consolidate", "load_full"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _layout(engine: Any) -> list[dict[str, Any]]:
    return [dict(name=g.name, names=[p._zero_name for p in g.params], shapes=[tuple(s) for s in g.shapes],
                 numel=g.numel, padded=g.padded) for g in engine.groups]


def _trainable_names(engine: Any) -> list[str]:
    return [n for n, p in engine.model.named_parameters() if p.requires_grad]


def shard_state(engine: Any) -> dict[str, Any]:
    """This rank's part of the training state (call between steps)."""
    groups = []
    for master, layout in zip(engine.master, _layout(engine)):
        state = engine.optimizer.state.get(master, {})
        groups.append(dict(layout, values=master.detach().float().cpu().clone(),
                           **{k: state[k].cpu().clone() for k in _MOMENTS if k in state},
                           step=float(state["step"]) if "step" in state else 0.0))
    return dict(world_size=engine.world_size, rank=engine.rank, stage=engine.stage,
                trainable=_trainable_names(engine), hyper={k: v for k, v in engine.optimizer.param_groups[0].items()
                                                           if k != "params"}, groups=groups)


def save_shards(engine: Any, prefix: str) -> str:
    """Write :func:`shard_state` to ``{prefix}.rank{R}-of-{N}.pt``; returns the path."""
    path = f"{prefix}.rank{engine.rank}-of-{engine.world_size}.pt"
    torch.save(shard_state(engine), path)
    return path


def load_shards(engine: Any, state: dict[str, Any]) -> None:
    """Load this rank's own :func:`shard_state` back.

    Raises:
        ValueError: saved with another world size, rank, stage or grouping, or for parameters of other
            shapes (consolidate, then load_full; a model of another shape cannot take it at all).
    """
    saved = (state["world_size"], state["rank"], state["stage"], [g["names"] for g in state["groups"]])
    here = (engine.world_size, engine.rank, engine.stage, [g["names"] for g in _layout(engine)])
    if saved != here:
        raise ValueError(f"this shard was saved by rank {saved[1]} of world_size={saved[0]} at stage {saved[2]}, "
                         f"this is rank {here[1]} of world_size={here[0]} at stage {here[2]} (or the groups differ); "
                         "join all ranks' shards with consolidate(...) and load the result with load_full(...)")
    _check_shapes("the shard", {n: tuple(s) for g in state["groups"] for n, s in zip(g["names"], g["shapes"])},
                  {n: tuple(s) for g in _layout(engine) for n, s in zip(g["names"], g["shapes"])})
    for master, group in zip(engine.master, state["groups"]):
        _set(engine, master, group["values"], {k: group[k] for k in _MOMENTS if k in group}, group["step"])
    if engine.stage in (1, 2):  # every rank's updated part, as after a step
        for group in engine.groups:
            engine.all_gather(group.full, group.shard.clone())


def _check_shapes(what: str, given: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError naming the parameters whose shapes differ between ``given`` and the engine's model."""
    differ = [f"{n}: {tuple(given[n])} where the model has {tuple(s)}" for n, s in expected.items()
              if n in given and tuple(given[n]) != tuple(s)]
    if differ:
        raise ValueError(f"{what} does not fit this model, {len(differ)} parameter(s) differ in shape: "
                         + "; ".join(differ[:3]) + ("; ..." if len(differ) > 3 else "")
                         + " (was it saved from a model of another size or vocabulary?)")


def _set(engine: Any, master: torch.Tensor, values: torch.Tensor, moments: dict[str, torch.Tensor],
         step: float) -> None:
    with torch.no_grad():
        master.copy_(values)
        for group, m in zip(engine.groups, engine.master):  # bf16: the model's copy follows the master
            owned = group.full if engine.stage == 0 else group.shard
            if m is master and owned is not master:
                owned.copy_(master)
    if moments:
        engine.optimizer.state[master] = dict(step=torch.tensor(step),
                                              **{k: v.to(master.device, copy=True) for k, v in moments.items()})


def consolidate(shards: Sequence[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every rank's :func:`shard_state` -> (model state dict of the trainable parameters, AdamW state dict).

    Raises:
        ValueError: no shards, or shards missing, repeated, or from different runs.
    """
    if not shards:
        raise ValueError("consolidate needs the shard_state(...) of every rank (a list of world_size dicts), got none")
    world_size = shards[0]["world_size"]
    if sorted(s["rank"] for s in shards) != list(range(world_size)) or len({s["world_size"] for s in shards}) > 1:
        raise ValueError(f"consolidate needs one shard from each of ranks 0..{world_size - 1}, got ranks "
                         f"{sorted(s['rank'] for s in shards)}")
    shards = sorted(shards, key=lambda s: s["rank"])
    stage, model_state, per_param = shards[0]["stage"], {}, {}
    for k, layout in enumerate(shards[0]["groups"]):
        full = {key: (torch.cat([s["groups"][k][key] for s in shards]) if stage else shards[0]["groups"][k][key])
                for key in ("values",) + _MOMENTS if key in layout}
        offset = 0
        for name, shape in zip(layout["names"], layout["shapes"]):
            n = torch.Size(shape).numel()
            model_state[name] = full["values"][offset:offset + n].view(shape).clone()
            per_param[name] = {m: full[m][offset:offset + n].view(shape).clone() for m in _MOMENTS if m in full}
            per_param[name]["step"] = torch.tensor(layout["step"])
            offset += n
    order = shards[0]["trainable"]
    optim_state = dict(state={i: per_param[n] for i, n in enumerate(order) if len(per_param[n]) > 1},
                       param_groups=[dict(shards[0]["hyper"], params=list(range(len(order))))])
    return model_state, optim_state


def load_full(engine: Any, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """Cut this rank's shard out of a plain model state dict and AdamW state dict (any world size).

    Raises:
        ValueError: a trainable parameter missing from ``model_state``, or one of another shape.
    """
    order = _trainable_names(engine)
    missing = [n for n in order if n not in model_state]
    if missing:
        raise ValueError(f"model_state lacks the trainable parameters {missing[:3]}{'...' if len(missing) > 3 else ''}")
    shapes = {p._zero_name: tuple(s) for g in engine.groups for p, s in zip(g.params, g.shapes)}
    _check_shapes("model_state", {n: tuple(model_state[n].shape) for n in shapes}, shapes)
    states = {name: optim_state["state"].get(i, {}) for i, name in enumerate(order)}
    for group, master in zip(engine.groups, engine.master):
        names = [p._zero_name for p in group.params]
        flat = {key: torch.zeros(group.padded) for key in ("values",) + _MOMENTS}
        for name, offset in zip(names, group.offsets):
            n = model_state[name].numel()
            flat["values"][offset:offset + n] = model_state[name].reshape(-1)
            for m in _MOMENTS:
                if m in states[name]:
                    flat[m][offset:offset + n] = states[name][m].reshape(-1)
        part = slice(None) if engine.stage == 0 else slice(engine.rank * group.shard_numel,
                                                            (engine.rank + 1) * group.shard_numel)
        moments = {m: flat[m][part] for m in _MOMENTS} if _MOMENTS[0] in states[names[0]] else {}
        _set(engine, master, flat["values"][part], moments, float(states[names[0]].get("step", 0.0)))
        if engine.stage in (1, 2):  # the other ranks' parts of the parameters, as after a step
            with torch.no_grad():
                group.full.copy_(flat["values"].to(group.full.dtype))
