"""Exactness checks that run inside ranks: each split layer, and GPT-2, against the dense original.

Each function is a ``launch`` worker (``fn(rank, world_size, ...)``) that returns the
largest differences it found, so a test asserts them and a notebook prints them. Every
rank builds the dense original from one seed and compares its shard with the same
slice of the dense result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.models import build_gpt2
from parallel_lib.models.attention import allowed_keys
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.convert import gather_dense, tensor_parallelize
from parallel_lib.tensor_parallel.sequence import sync_sequence_parallel_grads
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_lib.tensor_parallel.batches import TPConfig, make_batches

__all__ = ["mlp_check", "gpt2_check", "bad_input_check", "layer_trace", "block_saved_bytes", "many", "diff"]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors (``inf`` when either holds a NaN or an infinity)."""
    return max_abs_difference(a, b)


def mlp_check(rank: int, world_size: int, sequence_parallel: bool = False, hidden: int = 16,
              batch: int = 2, seq: int = 8) -> dict[str, Any]:
    """A column-parallel then row-parallel MLP against the dense one: outputs, input and weight gradients.

    Returns ``{"output", "input_grad", "column_weight_grad", "row_weight_grad", "row_bias_grad"}``
    (largest differences) and ``"collectives"``: the counted ``{kind: (calls, bytes)}``.
    """
    torch.manual_seed(0)
    dense_col, dense_row = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    upstream = torch.randn(batch, seq, hidden)
    y = dense_row(F.gelu(dense_col(x)))
    y.backward(upstream)

    col = ColumnParallelLinear.from_dense(dense_col, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_dense(dense_row, sequence_parallel=sequence_parallel)
    tp, r = R.group_size(None), R.group_rank(None)
    slice_seq = (lambda t: t.chunk(tp, 1)[r]) if sequence_parallel else (lambda t: t)
    x_mine = slice_seq(x.detach()).clone().requires_grad_(True)
    with count_collectives() as counter:
        hidden_mine = col(x_mine)
        y_mine = row(F.gelu(hidden_mine))
        y_mine.backward(slice_seq(upstream))
    row_bias_grad = row.bias.grad.clone()
    if sequence_parallel:  # each rank's bias saw its slice of the sequence
        torch.distributed.all_reduce(row_bias_grad)
    return dict(output=diff(y_mine, slice_seq(y)), input_grad=diff(x_mine.grad, slice_seq(x.grad)),
                column_weight_grad=diff(col.weight.grad, dense_col.weight.grad.chunk(tp, 0)[r]),
                row_weight_grad=diff(row.weight.grad, dense_row.weight.grad.chunk(tp, 1)[r]),
                row_bias_grad=diff(row_bias_grad, dense_row.bias.grad), collectives=counter.by_kind())


def gpt2_check(rank: int, world_size: int, config: TPConfig, naive_qkv: bool = False,
               recompute: bool = False) -> dict[str, Any]:
    """Tensor-parallel GPT-2 against Hugging Face's dense model on one padded batch.

    Returns the largest differences of the logits (on tokens that are not padding), the
    loss and every parameter's gradient (gathered into the dense layout), and the step's
    counted collectives (forward and backward). With ``recompute`` every block runs under
    ``torch.utils.checkpoint`` (keeps its input, runs its forward again in backward), so the
    counted step holds the recomputed forward's collectives too.
    """
    dense = build_gpt2(config.model, config.vocab_size, config.seed, **config.overrides())
    model = tensor_parallelize(dense, None, config.sequence_parallel, naive_qkv=naive_qkv)
    batch = make_batches(config)[0]
    ids, mask, labels, weights = batch["input_ids"], batch["attention_mask"], batch["labels"], batch["label_token_weights"]
    logits = dense(ids, attention_mask=mask).logits
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss = (ce * weights.flatten()).sum() / weights.sum()
    loss.backward()

    blocks = model.transformer.h
    if recompute:  # the same blocks (same parameters), each behind a checkpoint
        model.transformer.h = nn.ModuleList(_Recomputed(b) for b in blocks)
    with count_collectives() as counter:
        mine = model(ids, mask)
        forward_calls = counter.by_kind()
        my_loss = model.loss(mine, labels, weights)
        my_loss.backward()
    model.transformer.h = blocks
    sync_sequence_parallel_grads(model)
    gathered_logits = R._all_gather(mine.detach(), -1, None)
    for p in model.parameters():  # carry the gradients through gather_dense by swapping them in
        p.data, p.grad = p.grad, p.data
    grads = gather_dense(model)
    keep = mask.bool()
    grad_diff = max(diff(g, p.grad) for (name, g), p in zip(grads.named_parameters(), dense.parameters()))
    return dict(logits=diff(gathered_logits[keep], logits[keep]), loss=diff(my_loss, loss),
                grads=grad_diff, forward=forward_calls, step=counter.by_kind())


class _Recomputed(nn.Module):
    """A block that keeps only its input and runs its whole forward again in backward (full recomputation).

    As Megatron's recomputation does, the whole forward: torch's non-reentrant checkpoint would stop
    by default once it has what backward needs, before the MLP's closing all-reduce (one of the
    block's two), so early stopping is turned off here.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, cache: Any = None) -> torch.Tensor:
        with set_checkpoint_early_stop(False):
            return checkpoint(self.block, x, allowed, cache, use_reentrant=False)


def bad_input_check(rank: int, world_size: int) -> dict[str, str]:
    """The errors a rank gets for a head count the group's size does not divide and for a group without it.

    Returns ``{"heads": message, "group": message}`` ("" where nothing was raised).
    """
    model = build_gpt2("tiny", vocab_size=96 * world_size)  # 4 heads
    errors = {}
    try:
        tensor_parallelize(model, None)
        errors["heads"] = ""
    except ValueError as e:
        errors["heads"] = str(e)
    others = torch.distributed.new_group([r for r in range(world_size) if r != 0])
    # every rank waits until the group's members have connected: a member that returned (and left) while
    # another was still connecting to it made that one fail with "connection closed by peer" (CI, loaded)
    torch.distributed.barrier()
    if rank == 0:
        try:
            tensor_parallelize(build_gpt2("tiny", vocab_size=96, n_head=2), others)
            errors["group"] = ""
        except ValueError as e:
            errors["group"] = str(e)
    return errors


def layer_trace(rank: int, world_size: int, sequence_parallel: bool = False, batch: int = 2,
                seq: int = 8) -> list[Any]:
    """The operators one GPT-2 block issues, forward then backward, as :func:`.regions.record_regions` saw them.

    The chapter's widget replays this record: it is the layer code's own, not a drawing of it.
    """
    model = tensor_parallelize(build_gpt2("tiny", vocab_size=64 * world_size, n_layer=1), None, sequence_parallel)
    local_seq = seq // world_size if sequence_parallel else seq
    x = torch.randn(batch, local_seq, model.config.n_embd, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    with R.record_regions() as trace:
        y = model.transformer.h[0](x, allowed_keys(seq))
        y.sum().backward()
    return trace


def block_saved_bytes(rank: int, world_size: int, sequence_parallel: bool = False, dropout: float = 0.0,
                      batch: int = 2, seq: int = 16) -> int:
    """Bytes autograd saves for backward in one forward of one tensor-parallel GPT-2 block (the tensor census).

    :class:`~parallel_lib.common.saved_tensors.SavedTensors` counts each storage once and leaves the
    parameters out; the block's input is a leaf (not counted), the attention mask (``s²`` bools the
    whole model shares) is. Under sequence parallelism the input is this rank's slice of the sequence.
    """
    model = tensor_parallelize(build_gpt2("tiny", vocab_size=64 * world_size, n_layer=1, resid_pdrop=dropout,
                                          attn_pdrop=dropout, embd_pdrop=dropout), None, sequence_parallel)
    model.train()
    local_seq = seq // world_size if sequence_parallel else seq
    x = torch.randn(batch, local_seq, model.config.n_embd, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    with SavedTensors(model) as saved:
        y = model.transformer.h[0](x, allowed_keys(seq))
    y.sum().backward()
    return saved.nbytes


def many(rank: int, world_size: int, calls: list[tuple[Any, tuple]]) -> list[Any]:
    """Run several workers ``fn(rank, world_size, *args)`` one after the other in the same ranks (one launch)."""
    return [fn(rank, world_size, *args) for fn, args in calls]

