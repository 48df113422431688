"""Reference solutions of the classroom exercises, written as a student would write them.

Each function has the signature of its stub cell and uses only Python, ``math`` and
``torch``, so a teacher can show it as the answer. The checkers do not compare against
these: they compare against the library's own functions (``ring_chunks``,
``get_device_map``, ``training_memory``, ...), so the test suite that runs every checker
on these solutions also checks that two independent writings of each idea agree.
Every exercise's answer is here, ``average_token_gradients``, ``_clock_cycles`` and ``pipeline_bubble``
included (their checkers compare with the library's own versions). A graded lab removes this
file (``python -m parallel_lib.exercises hide-solutions``); the checkers do not need it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["rank_slice", "ALL_REDUCE_PREDICTION",
           "partition_indices", "local_batch_size", "steps_per_epoch", "WRONG_DP_LOOP",
           "average_token_gradients", "attach_bucketed_allreduce", "ring_bytes_sent", "ring_send_chunk",
           "balanced_device_map", "device_map_under_limit", "training_bytes",
           "_clock_cycles", "pipeline_bubble", "gpipe_step_time", "one_f_one_b_order", "micro_batches_for_bubble",
           "bytes_per_device", "plan_parallelism", "ring_exchange_order",
           "zero_bytes_per_rank", "zero3_bytes_sent", "zero2_rank", "clip_grad_norm_sharded",
           "row_parallel_forward", "tp_operators", "vocab_cross_entropy",
           "linear_weight_grad", "interleaved_bubble", "SCHEDULE_LAB", "REPAIR_DEADLOCK",
           "largest_batch", "gqa_decode_step", "cache_step", "PIPELINE_THROUGHPUT",
           "CHOSEN_LAYOUT", "OOM_ANSWER", "LAYOUT_REASON", "mesh_coords",
           "merge_attention", "zigzag_positions", "BUSIEST_SHARE",
           "dispatch_rows", "combine_rows", "BALANCE_EFFECT",
           "BUG_HUNT_1", "BUG_HUNT_2", "BUG_HUNT_3",
           "block_slot", "admit_requests", "accept_draft"]


# --------------------------------------------------------------------------- chapter 00
def rank_slice(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(numel, world_size)  # the first `extra` ranks take one element more
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# 4 ranks, rank r holds [r + 1, 10 r]: the element-wise sum over ranks, on every rank
ALL_REDUCE_PREDICTION = [1.0 + 2.0 + 3.0 + 4.0, 0.0 + 10.0 + 20.0 + 30.0]


# --------------------------------------------------------------------------- chapter 01
def partition_indices(n: int, world_size: int, seed: int) -> list[list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()  # same on every rank
    base, extra = divmod(n, world_size)
    sizes = [base + (1 if r < extra else 0) for r in range(world_size)]  # sum(sizes) == n: nobody is dropped
    starts = [sum(sizes[:r]) for r in range(world_size)]
    return [order[start:start + size] for start, size in zip(starts, sizes)]


def local_batch_size(global_batch_size: int, world_size: int) -> int:
    if global_batch_size < world_size or global_batch_size % world_size:
        raise ValueError(f"global_batch_size={global_batch_size} does not split evenly over "
                         f"world_size={world_size} ranks")
    return global_batch_size // world_size


def steps_per_epoch(n: int, world_size: int, global_batch_size: int, drop_last: bool = False) -> int:
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)  # padded or trimmed to equal shares
    return math.ceil(per_rank / local_batch_size(global_batch_size, world_size))


# B steps before it averages: each replica updates with its own gradient, and the copies drift
# apart. C is right: (loss / N) summed over N ranks is the mean, exactly what A computes.
WRONG_DP_LOOP = ("B", 1)


# --------------------------------------------------------------------------- chapter 02
def average_token_gradients(model, n_tokens: int) -> None:
    import torch.distributed as dist
    # rank r holds the gradient of (sum of its token losses) / n_r: times n_r it is the gradient of
    # the sum; summed over the ranks and divided by all tokens, the gradient of the global mean
    total = torch.tensor([float(n_tokens)])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    for param in model.parameters():
        if param.grad is None:  # a frozen layer, or one this batch did not reach
            continue
        param.grad *= n_tokens
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= total.item()


def attach_bucketed_allreduce(model, bucket_bytes: int):
    import torch.distributed as dist
    params = [p for p in model.parameters() if p.requires_grad]
    buckets, current, size = [], [], 0
    for p in reversed(params):  # backward produces the last layers' gradients first
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    ready, handles = [0] * len(buckets), []

    def hook(p):  # runs during backward, once p.grad is complete
        i = bucket_of[id(p)]
        ready[i] += 1
        if ready[i] == len(buckets[i]):  # the bucket is full: reduce it while backward goes on
            flat = torch.cat([q.grad.flatten() for q in buckets[i]])
            handles.append((i, flat, dist.all_reduce(flat, async_op=True)))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i, flat, handle in handles:
            handle.wait()
            flat /= dist.get_world_size()
            offset = 0
            for q in buckets[i]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        handles.clear()
        ready[:] = [0] * len(buckets)

    return finish


def ring_bytes_sent(nbytes: float, world_size: int) -> float:
    # 2(N-1) steps (reduce-scatter, then all-gather), one chunk of S/N bytes each
    return 2 * (world_size - 1) * nbytes / world_size


def ring_send_chunk(rank: int, step: int, world_size: int) -> int:
    if step < world_size - 1:  # reduce-scatter: pass on the chunk received last step
        return (rank - step) % world_size
    # all-gather: start with the chunk this rank finished reducing, (rank + 1) % N
    return (rank + 1 - (step - (world_size - 1))) % world_size


# --------------------------------------------------------------------------- chapter 03
def balanced_device_map(n_layers: int, n_devices: int) -> dict[int, list[int]]:
    base, extra = divmod(n_layers, n_devices)
    device_map, first = {}, 0
    for device in range(n_devices):
        size = base + (1 if device < extra else 0)
        device_map[device] = list(range(first, first + size))
        first += size
    return device_map


def device_map_under_limit(layer_bytes: list[float], capacity: float) -> dict[int, list[int]]:
    # greedy in order: a device takes layers until the next one would overflow it. Whole layers
    # leave a gap at the end of each device, which is why ceil(total / capacity) can be too few.
    if max(layer_bytes) > capacity:
        raise ValueError(f"a layer of {max(layer_bytes)} bytes does not fit in {capacity}")
    device_map, used = {0: []}, 0.0
    for position, size in enumerate(layer_bytes):
        if used + size > capacity:
            device_map[len(device_map)], used = [], 0.0
        if 0 < position < len(layer_bytes) - 1:  # a block (not the embedding, not the head)
            device_map[len(device_map) - 1].append(position - 1)
        used += size
    return device_map


def training_bytes(n_params: int, dtype: str = "fp16", optimizer: Optional[str] = "adamw") -> float:
    width = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    if optimizer is None:  # inference: the weights only
        return width * n_params
    master = 4 if width < 4 else 0  # mixed precision updates an fp32 copy of the weights
    states = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]  # fp32 values per parameter
    return (width + width + master + 4 * states) * n_params


# --------------------------------------------------------------------------- chapter 04
def one_f_one_b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[str]:
    warmup = min(num_stages - 1 - stage, num_micro_batches)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(num_micro_batches - warmup):  # steady state: one forward in, one backward out
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(num_micro_batches - warmup, num_micro_batches)]


def _clock_cycles(num_batches: int, num_partitions: int):
    for k in range(num_batches + num_partitions - 1):  # micro-batch i reaches partition j at tick i + j
        yield [(k - j, j) for j in range(num_partitions) if 0 <= k - j < num_batches]


def pipeline_bubble(p: int, m: int) -> float:
    # a step lasts m + p - 1 slots; each stage works m of them
    return (p - 1) / (m + p - 1)


def gpipe_step_time(p: int, m: int, forward: float, backward: float, comm: float) -> float:
    # without hand-overs: m + p - 1 slots of forward + backward. A hand-over never holds a stage, so
    # only those on the critical path count: micro-batch 0 crossing the p - 1 boundaries on the way
    # down (the last stage's forwards then follow back to back), and the last micro-batch's
    # gradient crossing them on the way back up
    return (m + p - 1) * (forward + backward) + 2 * (p - 1) * comm


def micro_batches_for_bubble(p: int, target: float, stage_costs) -> int:
    from parallel_lib.common.timeline import idle_fraction
    from parallel_lib.pipeline_parallel import one_f_one_b, simulate
    m = 1  # more micro-batches only shrink the bubble: the first m that meets the target is the fewest
    while idle_fraction(simulate(one_f_one_b(p, m), stage_costs)) > target:
        m += 1
    return m


# --------------------------------------------------------------------------- chapter 05
def bytes_per_device(n_params: int, pipeline_stages: int, data_replicas: int) -> float:
    # every replica holds the whole model; a replica's stages share it (16 bytes/param, fp16 Adam)
    return 16 * n_params / pipeline_stages


def plan_parallelism(fits, n_gpus: int, n_layers: int) -> Optional[tuple[int, int]]:
    # the bubble (p-1)/(m+p-1) grows with p: try the fewest stages first; every GPU left over is
    # another replica, and fits must be asked with those replicas (each then holds less of the batch)
    for stages in range(1, min(n_gpus, n_layers) + 1):
        if fits(stages, n_gpus // stages):
            return stages, n_gpus // stages
    return None


def ring_exchange_order(rank: int, world_size: int) -> list[tuple[str, int]]:
    # if all send first, all wait; rank 0 receiving first breaks the cycle: rank N-1's send
    # completes, then N-2's, ..., then rank 0 sends last
    send, recv = ("send", (rank + 1) % world_size), ("recv", (rank - 1) % world_size)
    return [recv, send] if rank == 0 else [send, recv]


# --------------------------------------------------------------------------- chapter 06
def zero_bytes_per_rank(n_params: float, world_size: int, stage: int) -> float:
    params, grads, optimizer = 2 * n_params, 2 * n_params, 12 * n_params
    if stage >= 1:
        optimizer /= world_size
    if stage >= 2:
        grads /= world_size
    if stage >= 3:
        params /= world_size
    return params + grads + optimizer


def zero3_bytes_sent(n_params: float, world_size: int, bytes_per_param: int) -> float:
    one_pass = (world_size - 1) / world_size * n_params * bytes_per_param
    return 3 * one_pass  # all-gather forward, all-gather backward, reduce-scatter gradients


def zero2_rank(flat_params, make_optimizer):
    import torch
    import torch.distributed as dist
    # the two halves of the ring all-reduce, by the name this torch gives them
    from parallel_lib.runtime.compat import all_gather_single as all_gather, reduce_scatter_single as reduce_scatter
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat_params.numel() // n
    shard = flat_params[rank * size:(rank + 1) * size].clone()  # this rank's parameters, a tensor of its own
    optimizer = make_optimizer([shard])  # AdamW's two moments: for this shard only

    def step(flat_grad):
        grad = torch.empty(size, dtype=flat_grad.dtype)
        reduce_scatter(grad, flat_grad)  # the sum over the ranks, of my shard only
        shard.grad = grad / n            # the mean, as one process on the whole batch
        optimizer.step()
        shard.grad = None                # nothing of the gradient is kept between steps
        all_gather(flat_params, shard)   # everyone's updated shard, into the buffer the model reads

    return step


def clip_grad_norm_sharded(shards, max_norm):
    import torch
    import torch.distributed as dist
    # the whole gradient's squared norm is the sum of every rank's squares: add squares, never norms
    squares = sum((s.double().pow(2).sum() for s in shards), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = min(1.0, max_norm / (float(norm) + 1e-6))  # torch's factor, never above 1
    for s in shards:
        s.mul_(scale)
    return norm


# --------------------------------------------------------------------------- chapter 07
def row_parallel_forward(x_mine, weight_mine, bias, all_reduce):
    # each rank's slice of the input features times its columns of the weight is a partial product
    # of the whole output; their sum is x @ weight.T. The bias is whole on every rank: add it once.
    return all_reduce(x_mine @ weight_mine.T) + bias


def tp_operators():
    import torch
    import torch.distributed as dist

    class CopyToRegion(torch.autograd.Function):  # f: before the column-parallel layer
        @staticmethod
        def forward(ctx, x):
            return x  # every rank already holds the whole input

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()  # each rank's slice sent back its own term of dL/dx: add them up
            dist.all_reduce(grad)
            return grad

    class ReduceFromRegion(torch.autograd.Function):  # g: after the row-parallel layer
        @staticmethod
        def forward(ctx, x):
            x = x.clone()  # partial products: their sum is the dense output
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad  # the gradient of a sum reaches each term unchanged

    return CopyToRegion.apply, ReduceFromRegion.apply


def vocab_cross_entropy(logits_mine, target, vocab_start):
    import torch.distributed as dist
    z = logits_mine.float()  # exp and sums in float32: bf16/fp16 keep 8 or 11 bits
    counted = target != -100
    top = z.max(dim=-1).values  # the largest logit over the whole vocabulary, so that every exp <= 1
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = z - top[:, None]
    total = shifted.exp().sum(dim=-1)  # the softmax's denominator, summed over every rank's slice
    dist.all_reduce(total)
    n = z.shape[-1]
    mine = (target >= vocab_start) & (target < vocab_start + n)  # only one rank holds each target
    index = (target - vocab_start).clamp(0, n - 1)
    picked = shifted.gather(-1, index[:, None])[:, 0] * mine
    dist.all_reduce(picked)
    return (total.log() - picked) * counted


# --------------------------------------------------------------------------- chapter 08 (08a and 08b)
def linear_weight_grad(x, grad_y):
    # every dimension but the last holds rows (a batch of sequences too); each row adds
    # (its output gradient) x (its input) to the weight's gradient and its output gradient to the bias's
    rows_x, rows_g = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    return rows_g.T @ rows_x, rows_g.sum(0)


def interleaved_bubble(p: int, m: int, v: int) -> float:
    # the fill and the drain are p - 1 steps each of a stage, 1/v of a rank's share: (p-1)/v of m·(F+B)
    return (p - 1) / (v * m)


# W costs twice B, so a rank keeps one more micro-batch than ZB-H1 (5 instead of 4) to fill the waits of
# the drain with Ws; ranks 0 and 1 run that extra forward during the warm-up
SCHEDULE_LAB = ["F0 F1 F2 F3 F4 B0 W0 B1 B2 F5 W1 B3 B4 F6 W2 F7 W3 B5 W4 B6 W5 B7 W6 W7",
                "F0 F1 F2 F3 F4 B0 W0 B1 B2 W1 B3 B4 F5 W2 F6 W3 B5 F7 W4 B6 W5 B7 W6 W7",
                "F0 F1 F2 B0 F3 B1 F4 B2 W0 B3 B4 W1 F5 W2 B5 F6 W3 B6 F7 W4 B7 W5 W6 W7",
                "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 W0 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"]

# rank 1 ran F1 before B0, but rank 0 sends F1 only after its B0, which needs rank 1's B0: a cycle
REPAIR_DEADLOCK = "F0 B0 F1 B1"


# --------------------------------------------------------------------------- chapter 09
def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
    heads_here = max(kv_heads // tp, 1)  # a rank keeps its share of the KV heads, or one copy of its head
    per_request = 2 * n_layers * heads_here * head_dim * bytes_per_element * seq_len  # a K and a V per head
    return kv_budget_bytes // per_request


def gqa_decode_step(x, wq, wk, wv, wo, k_cache, v_cache, length):
    batch, n_kv, _, head_dim = k_cache.shape
    n_heads = wq.shape[0] // head_dim
    q = (x @ wq.T).view(batch, n_heads, 1, head_dim)
    k_cache[:, :, length] = (x @ wk.T).view(batch, n_kv, head_dim)  # the new token's slot is `length`
    v_cache[:, :, length] = (x @ wv.T).view(batch, n_kv, head_dim)
    k = k_cache[:, :, :length + 1].repeat_interleave(n_heads // n_kv, dim=1)  # head h reads KV head h // group
    v = v_cache[:, :, :length + 1].repeat_interleave(n_heads // n_kv, dim=1)
    scores = q @ k.transpose(-1, -2) * head_dim ** -0.5  # (batch, heads, 1, length + 1)
    out = scores.softmax(dim=-1) @ v                        # (batch, heads, 1, head_dim)
    return out.reshape(batch, n_heads * head_dim) @ wo.T


def cache_step(k_cache, v_cache, k_new, v_new, lengths):
    rows = torch.arange(k_cache.shape[0])
    k_cache[rows, :, lengths] = k_new[:, :, 0]  # row b's next free slot is lengths[b]
    v_cache[rows, :, lengths] = v_new[:, :, 0]
    upto = int(lengths.max()) + 1
    mask = torch.arange(upto)[None, :] <= lengths[:, None]  # its tokens and the new one, not the padding
    return k_cache[:, :, :upto], v_cache[:, :, :upto], mask


# a 2-stage pipeline, a step of time t per stage: 1 request crosses both stages per token (1 token per 2t);
# 4 requests make 2 groups that keep both stages busy, each group step yielding 2 tokens (4 tokens per 2t)
PIPELINE_THROUGHPUT = (0.5, 2.0)


# --------------------------------------------------------------------------- chapter 10
# FSDP-style: dp 32 with ZeRO-3 shards everything, and its gathers and reduce-scatters hide behind each
# micro-batch's forward and backward (price's overlap), so no tensor or pipeline parallelism is needed
CHOSEN_LAYOUT = dict(dp=32, tp=1, pp=1, zero=3)

# 12 of the 16 bytes per parameter are the optimizer's (fp32 master and two moments); ZeRO-1 shards them
OOM_ANSWER = ("optimizer", 1)

# DP8 x TP2 with ZeRO-1 is the fastest; ZeRO-2 would shard the gradients too, but reduce-scatters them after
# each of its 8 micro-batches, and the backward does not hide all of it: one stage up is predicted slower
LAYOUT_REASON = dict(layout=dict(dp=8, tp=2, pp=1, zero=1), neighbour=dict(dp=8, tp=2, pp=1, zero=2),
                     neighbour_gib=20.7, neighbour_seconds=3.26)


def mesh_coords(rank, dp, tp, pp, order):
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    coords, stride = {}, 1
    for axis in order.split("-"):  # fastest first: an axis steps once per sweep of the axes before it
        coords[axis] = rank // stride % sizes[axis]
        stride *= sizes[axis]
    return coords


# --------------------------------------------------------------------------- chapter 11
def merge_attention(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)                     # shift by the larger: exp never overflows
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)   # both -inf: weights 0, not NaN
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)   # each block's denominator, shifted
    total = weight_a + weight_b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / safe[..., None]  # a weighted mean
    lse = top + torch.log(total)                          # log of the two denominators' sum
    return out, lse


def zigzag_positions(seq_len, cp, rank):
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank               # the i-th chunk from the start and from the end
    return list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))


# rank i of the contiguous split holds positions i·s/cp .. (i+1)·s/cp − 1: about (2i + 1)/cp² of the causal
# triangle's s²/2 entries; the last rank, i = cp − 1, (2·cp − 1)/cp² = 7/16 at cp = 4
BUSIEST_SHARE = 7 / 16


# --------------------------------------------------------------------------- chapter 12
def dispatch_rows(experts, kept, n_experts, ep):
    token, slot = torch.nonzero(kept, as_tuple=True)             # the kept choices, in token order
    order = torch.argsort(experts[token, slot], stable=True)     # sorted by expert
    token, slot = token[order], slot[order]
    counts = torch.bincount(experts[token, slot], minlength=n_experts)
    send = counts.reshape(ep, n_experts // ep).sum(dim=1)       # rank q holds experts q·E/ep .. (q+1)·E/ep - 1
    return send.tolist(), token, slot


def combine_rows(back, token, slot, weights, n_tokens):
    weighted = weights[token, slot].unsqueeze(1).to(back.dtype) * back
    return back.new_zeros(n_tokens, back.shape[1]).index_add(0, token, weighted)  # a token's rows add up


# without capacity every choice is computed (64 rows), the busiest expert falls from 63 to ~18;
# with capacity 1.0 the busiest stays at its 16 slots, and the dropped choices (47 of 64) become rows again
BALANCE_EFFECT = dict(no_capacity="busiest", capacity="total")


# --------------------------------------------------------------------------- chapter 10b
# (each read from hunt("B") ... hunt("H"), then from the code that only the broken layouts run)
BUG_HUNT_1 = {
    "B": dict(where="parallel_lib.training.tp_stage.stage_loss", breaks=["tp2, m=2", "tp2+sp, m=2"]),
    "C": dict(where="parallel_lib.training.stage_gradients.reduce_stage_gradients",
              breaks=["pp2 1f1b, m=2", "pp2 gpipe, m=1"]),
}
BUG_HUNT_2 = {
    "D": dict(where="parallel_lib.pipeline_parallel.runtime.RankStages.forward",
              breaks=["dp2, m=2", "dp2 zero3, m=2", "tp2, m=2", "tp2+sp, m=2", "pp2 1f1b, m=2"]),
    "E": dict(where="parallel_lib.tensor_parallel.parallelize.split_block", breaks=["tp2, m=2", "tp2+sp, m=2"]),
    "F": dict(where="parallel_lib.sharding.layers.StageThreeHooks._before_backward", breaks=["dp2 zero3, m=2"]),
}
BUG_HUNT_3 = {
    "G": dict(where="parallel_lib.training.step.pipeline_step",
              breaks=["dp2, m=2", "dp2 zero1, m=1", "dp2 zero3, m=2", "tp2, m=2", "tp2+sp, m=2", "pp2 1f1b, m=2"]),
    "H": dict(where="parallel_lib.tensor_parallel.parallelize.parallelize_tp", breaks=["tp2+sp, m=2"]),
}


# --------------------------------------------------------------------------- chapter 13
def block_slot(table, block_size, position):
    block = table[position // block_size]         # the table maps the sequence's k-th block to a pool block
    return block * block_size + position % block_size


def admit_requests(free_blocks, waiting, running, max_batch, block_size):
    admitted = []
    for i, length in enumerate(waiting):           # oldest first
        if running + len(admitted) >= max_batch:
            break
        need = -(-length // block_size)            # blocks for all of its tokens, rounded up
        if need > free_blocks:
            break                                  # the head blocks the rest: nobody overtakes it
        admitted.append(i)
        free_blocks -= need
    return admitted


def accept_draft(p, q, token, u):
    if u < min(1.0, float(p[token] / q[token])):
        return True, None
    residual = (p - q).clamp(min=0)                # where the target gives more than the draft
    return False, residual / residual.sum()
