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
