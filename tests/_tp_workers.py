"""Worker functions for tests/test_parallelize_tp.py, run inside ranks that ``launch`` spawns."""

from __future__ import annotations

import torch

from parallel_lib.models import build_model
from parallel_lib.runtime.mesh import Mesh
from parallel_lib.tensor_parallel import gather_dense, parallelize_tp, sync_sequence_parallel_grads
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.batches import TPConfig, make_batches


def train_steps(model: torch.nn.Module, config: TPConfig, group=None) -> tuple[torch.Tensor, list[float]]:
    """First-step logits and every step's loss of ``config.steps`` AdamW steps on ``make_batches(config)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model.train()
    first, losses = None, []
    for batch in make_batches(config):
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = model.loss(logits, batch["labels"], batch["label_token_weights"])
        loss.backward()
        sync_sequence_parallel_grads(model)
        optimizer.step()
        if first is None:
            first = R._all_gather(logits.detach(), -1, group) if group is not False else logits.detach()
        losses.append(float(loss.detach()))
    return first, losses


def one_model_tp(rank: int, world_size: int, config: TPConfig, via_mesh: bool) -> dict:
    """The one GPT-2 split by ``parallelize_tp`` over all ranks: first logits, losses, gathered parameters.

    ``via_mesh``: pass the ``RankMesh`` itself (its "tp" axis is used), else its tp group.
    """
    with Mesh(tp=world_size).build() as pm:
        model = build_model(config.model, config.vocab_size, config.seed, **config.overrides())
        parallelize_tp(model, pm if via_mesh else pm.group("tp"), sequence_parallel=config.sequence_parallel)
        logits, losses = train_steps(model, config, pm.group("tp"))
        state = {k: v.clone() for k, v in gather_dense(model).state_dict().items()}
        return dict(logits=logits, losses=losses, state=state, mesh_group=model.tp_info.group is pm.group("tp"))


def stages_in_a_row(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    """A TP shard cut into 2 pipeline stages run one after the other here: logits and loss vs the uncut shard."""
    from parallel_lib.common.models import build_gpt2
    from parallel_lib.training.tp_stage import TensorParallelStage, stage_loss
    from parallel_lib.tensor_parallel import tensor_parallelize

    config = TPConfig(sequence_parallel=sequence_parallel)
    batch = make_batches(config)[0]
    ids, labels, weights = batch["input_ids"], batch["labels"], batch["label_token_weights"]
    with Mesh(tp=world_size).build() as pm:
        model = tensor_parallelize(build_gpt2(config.model, config.vocab_size, config.seed), pm.group("tp"),
                                   sequence_parallel)
        whole = model(ids)
        stages = [TensorParallelStage(model, j, 2) for j in range(2)]
        x = ids
        for stage in stages:
            x = stage(x)
        loss = stage_loss(stages[1], labels, weights, float(weights.sum()))(x)
        return dict(logits=float((x - whole).abs().max()), shape=tuple(x.shape),
                    loss=abs(float(loss) - float(model.loss(whole, labels, weights))))


def ids_outside_the_vocabulary(rank: int, world_size: int) -> dict:
    """A TP shard against the dense model on ids outside the vocabulary and on the ignore label -100.

    Returns the error each side gives for ids 64, 500, -3 (vocabulary 64) as input and as labels,
    the per-token loss and its logits' gradient with some labels -100 (TP: gathered; dense:
    ``F.cross_entropy``), both models' losses, and the logits of a good batch run after the errors
    (a rank left inside a collective would hang or mismatch there).
    """
    import torch.nn.functional as F

    from parallel_lib.tensor_parallel.vocab import vocab_parallel_cross_entropy

    def error(fn) -> str:
        try:
            fn()
        except (ValueError, IndexError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return ""

    dense = build_model("tiny", 64, 3).eval()
    with Mesh(tp=world_size).build() as pm:
        group = pm.group("tp")
        model = parallelize_tp(build_model("tiny", 64, 3), group).eval()
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        out = {"input": {}, "labels": {}}
        for bad in (64, 500, -3):
            wrong = ids.clone()
            wrong[1, 5] = bad
            out["input"][bad] = (error(lambda: model(wrong)), error(lambda: dense(wrong)))
            logits = model(ids)
            out["labels"][bad] = (error(lambda: model.loss(logits, wrong)),
                                  error(lambda: dense.loss(dense(ids), wrong)))
        labels = ids.roll(-1, 1)
        labels[:, -3:] = -100
        local = model(ids).detach().requires_grad_()
        ce = vocab_parallel_cross_entropy(local, labels, model.tp_info.vocab_start, group)
        ce.sum().backward()
        out["ce"] = ce.detach()
        out["grad"] = R._all_gather(local.grad, -1, group)
        whole = dense(ids).detach().requires_grad_()
        dense_ce = F.cross_entropy(whole.flatten(0, 1), labels.flatten(), reduction="none").view(2, 8)
        dense_ce.sum().backward()
        out["dense_ce"], out["dense_grad"] = dense_ce.detach(), whole.grad
        out["loss"] = float(model.loss(model(ids), labels))
        out["dense_loss"] = float(dense.loss(dense(ids), labels))
        out["after"] = R._all_gather(model(ids).detach(), -1, group)
        out["dense_after"] = dense(ids).detach()
        return out
