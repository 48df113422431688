"""Context parallelism (chapter 11): tiled attention, the layouts, ring and Ulysses attention, their traffic.

The headline proofs run on gloo ranks: every rank's output and q, k, v gradients equal the
same shard of full attention in one process (fp32, 1e-5), at cp = 2 and 4, causal and not,
contiguous and zig-zag; the bytes each rank sent (the collective counter) equal the formula
from the algorithm's steps; the work each rank did (tiles it computed) shows the causal
imbalance of the contiguous split and its absence under zig-zag. One launch per cp holds
every case: starting ranks costs more than these attentions.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lib.context_parallel import (
    TileWork, attention_saved_bytes, check_ulysses, chunk_ids, cp_wire_bytes, full_attention, gather_sequence,
    hiding_seq_len, merge_partials, ring_attention, ring_step_flops, ring_step_time, saved_attention_bytes,
    shard_positions, shard_sequence, tiled_attention, tiled_forward, ulysses_attention)
from parallel_lib.context_parallel import cp_shard, parallelize_cp
from parallel_lib.context_parallel.verify import (Case, attention_check, cp_dp_training_check, gpt2_check, several,
                                                  stalled_peer_check, torch_context_parallel_check)
from parallel_lib.context_parallel.measure import (Shape, measure_context, measure_on_ranks, measure_one_process,
                                                   rank_rows)
from parallel_lib.models import build_model
from parallel_lib.runtime import launch

ATOL = 1e-5
MEASURED, MEASURE_SHAPE = [32, 64], Shape(heads=4, head_dim=8, block=8, repeats=1)


def _grads(attention, q, k, v, upstream, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, **kwargs)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


# --- attention in tiles ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len, block", [(50, 16), (32, 32), (7, 64)])  # ragged last tile; one tile; s < block
def test_tiled_attention_equals_softmax_attention_forward_and_backward(causal, seq_len, block):
    q, k, v, upstream = (torch.randn(2, 3, seq_len, 8) for _ in range(4))
    expected = _grads(full_attention, q, k, v, upstream, causal=causal)
    actual = _grads(tiled_attention, q, k, v, upstream, causal=causal, block=block)
    for name, got, want in zip(("output", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_attention_in_half_precision_keeps_the_dtype_and_stays_close(dtype):
    q, k, v, upstream = (torch.randn(1, 2, 40, 8, dtype=dtype) for _ in range(4))
    expected = _grads(full_attention, q, k, v, upstream, causal=True)
    actual = _grads(tiled_attention, q, k, v, upstream, causal=True, block=16)
    for name, got, want in zip(("output", "dq", "dk", "dv"), actual, expected):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2, msg=lambda m: f"{name}: {m}")


def test_tiled_forward_masks_by_position_and_skips_future_tiles():
    # zig-zag positions: rank 0 of cp=2 holds chunks 0 and 3 of 32 tokens
    q, k, v = (torch.randn(1, 2, 32, 4) for _ in range(3))
    q_pos = shard_positions(32, 2, 0, "zigzag")
    mine = q[:, :, q_pos]
    expected = full_attention(mine, k, v, causal=True, q_pos=q_pos, k_pos=torch.arange(32))
    work = TileWork()
    out, lse = tiled_forward(mine, k, v, causal=True, q_pos=q_pos, k_pos=torch.arange(32), block=8, work=work)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    # query tile 0 (positions 0..7) sees key tile 0 only; query tile 1 (24..31) sees all 4 key tiles
    assert (work.tiles, work.entries, work.allowed) == (5, 5 * 64, 36 + 3 * 64 + 36)
    assert torch.isfinite(lse).all()


def test_merge_of_two_halves_is_attention_over_all_keys():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    a = tiled_forward(q, k[:, :, :3], v[:, :, :3])
    b = tiled_forward(q, k[:, :, 3:], v[:, :, 3:])
    out, lse = merge_partials(*a, *b)
    whole_out, whole_lse = tiled_forward(q, k, v)
    torch.testing.assert_close(out, whole_out, rtol=0, atol=ATOL)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=ATOL)
    torch.testing.assert_close(out, full_attention(q, k, v), rtol=0, atol=ATOL)
    # a block the queries may not see at all (lse = -inf) changes nothing, and makes no NaN
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for merged, want in zip(merge_partials(*a, *empty), a):
        torch.testing.assert_close(merged, want, rtol=0, atol=0)
    assert torch.isneginf(merge_partials(*empty, *empty)[1]).all()
    assert not merge_partials(*empty, *empty)[0].isnan().any()
    with pytest.raises(ValueError, match="out_a, out_b must be"):
        merge_partials(a[0], a[1], a[0][:, :1], a[1])


@pytest.mark.parametrize("causal", [False, True])
def test_saved_bytes_grow_with_s_squared_for_full_attention_only(causal):
    """The census (autograd's saved tensors) equals the formula from what each attention saves."""
    b, n, d = 1, 2, 16
    measured = {}
    for s in (64, 128, 256):
        q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))
        full = saved_attention_bytes(full_attention, q, k, v, causal=causal)
        tiled = saved_attention_bytes(tiled_attention, q, k, v, causal=causal, block=32)
        assert full == pytest.approx(attention_saved_bytes("full", b, n, s, d, causal), rel=0.05)
        assert tiled == pytest.approx(attention_saved_bytes("tiled", b, n, s, d, causal), rel=0.05)
        measured[s] = (full, tiled)
    assert measured[256][0] / measured[128][0] == pytest.approx(4, rel=0.01)   # s²
    assert measured[256][1] / measured[128][1] == pytest.approx(2, rel=0.01)   # s
    with pytest.raises(ValueError, match="must require grad"):
        saved_attention_bytes(full_attention, q.detach(), k.detach(), v.detach())


def test_bad_attention_inputs_are_refused():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="q must be a tensor"):
        tiled_attention([1.0], q, q)
    with pytest.raises(ValueError, match="k must be 4-d"):
        tiled_attention(q, q[0], q)
    with pytest.raises(ValueError, match="share batch, heads and head_dim"):
        tiled_attention(q, torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4))
    with pytest.raises(ValueError, match="block must be an int >= 1"):
        tiled_attention(q, q, q, block=0)
    with pytest.raises(ValueError, match="q_pos must be a 1-d tensor of 8 positions"):
        tiled_forward(q, q, q, causal=True, q_pos=torch.arange(7))


# --- when a ring step hides its transfer ---------------------------------------------------------

def test_a_ring_step_computes_the_flops_the_formula_says():
    """PyTorch's FLOP counter on one step's attention (a whole block, in tiles), against ring_step_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    b, n, s, d, cp = 2, 3, 64, 8, 2
    q, k, v = (torch.randn(b, n, s // cp, d) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        tiled_forward(q, k, v, block=8)
    assert counter.get_total_flops() == ring_step_flops(b, n, s, d, cp)


def test_the_hiding_length_is_where_compute_overtakes_the_transfer():
    rate, alpha, beta = 4e14, 5e-6, 4e11          # a GPU's bf16 rate, an NVLink-like link
    s = hiding_seq_len(1, 32, 128, 16, rate, alpha, beta, itemsize=2)
    assert s % 32 == 0
    assert ring_step_time(1, 32, s, 128, 16, rate, alpha, beta, 2).hidden
    assert not ring_step_time(1, 32, s - 32, 128, 16, rate, alpha, beta, 2).hidden
    # without latency the root is L = 2·itemsize·F / (4·β) tokens per rank: 1000 here
    assert hiding_seq_len(1, 32, 128, 16, rate, 0.0, beta, itemsize=2) == pytest.approx(16 * 1000, abs=32)
    # a step moves one K and one V block: what the collective counter saw per step (test above)
    step = ring_step_time(1, 2, 32, 8, 2, 1.0, 0.0, 1.0)
    assert step.transfer_s == cp_wire_bytes("ring", 1, 2, 32, 8, 2).forward / (2 - 1)
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        hiding_seq_len(1, 2, 8, 2, 1e9, 0.0, 0.0)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        ring_step_time(1, 2, 8, 4, 2, 1e9, -1.0, 1e9)


# --- layouts --------------------------------------------------------------------------------------

def test_chunks_of_the_two_layouts():
    assert [chunk_ids(4, i) for i in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [chunk_ids(4, i, "zigzag") for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert shard_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shards_gather_back_to_the_sequence(layout):
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [shard_sequence(x, 3, i, layout) for i in range(3)]
    assert sorted(torch.cat(shards, 1)[0].tolist()) == list(range(24))
    assert torch.equal(gather_sequence(shards, layout), x)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        chunk_ids(2, 0, "striped")
    with pytest.raises(ValueError, match="index must be an int in 0..1"):
        chunk_ids(2, 2)
    with pytest.raises(ValueError, match="divisible by 2·cp = 4"):
        shard_positions(10, 2, 0)
    with pytest.raises(TypeError, match="x must be a tensor"):
        shard_sequence([1, 2], 1, 0)
    with pytest.raises(ValueError, match="every shard must hold as many tokens"):
        gather_sequence([torch.zeros(1, 2), torch.zeros(1, 4)])


# --- ring and Ulysses on ranks --------------------------------------------------------------------

def _cases(heads: int) -> list[Case]:
    exact = [Case(method, causal, layout, batch=2, heads=heads)
             for method in ("ring", "ulysses") for causal in (False, True) for layout in ("contiguous", "zigzag")]
    # the load-balance cases: small tiles, so that work counts resolve the causal triangle
    balance = [Case("ring", True, layout, heads=heads, seq_len=128, head_dim=4, block=4)
               for layout in ("contiguous", "zigzag")]
    return exact + balance


@pytest.fixture(scope="module")
def on_ranks():
    """One launch per cp: the attention cases; at cp = 2 also GPT-2 with ring attention, and PyTorch's CP.

    ``{cp: (each rank's case results, each rank's other results)}``.
    """
    runs = {}
    for cp in (2, 4):
        jobs = [(attention_check, (_cases(4),))] + ([(gpt2_check, ()), (torch_context_parallel_check, ()),
                                                    (measure_on_ranks, (MEASURED, MEASURE_SHAPE))] if cp == 2
                                                   else [(cp_dp_training_check, ()), (cp_tp_training, ()),
                                                         (measure_on_ranks, (MEASURED, MEASURE_SHAPE))])
        results = launch(several, cp, jobs, backend="gloo", timeout=180, startup_timeout=120)
        runs[cp] = ([r[0] for r in results], [r[1:] for r in results])
    return runs


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_ulysses_equal_full_attention_forward_and_every_gradient(on_ranks, cp):
    results = on_ranks[cp][0]
    for rank, found in enumerate(results):
        for result in found:
            case = result["case"]
            for name, error in result["errors"].items():
                assert error < ATOL, f"cp={cp}, rank {rank}, {case}: {name} differs by {error:.2e}"


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_each_rank_sends_and_keeps_match_the_algorithm(on_ranks, cp):
    results = on_ranks[cp][0]
    for found in results:
        for result in found:
            case = result["case"]
            expected = cp_wire_bytes(case["method"], case["batch"], case["heads"], case["seq_len"],
                                     case["head_dim"], cp)
            assert result["forward_bytes"] == expected.forward, case
            assert result["saved_bytes"] == attention_saved_bytes(case["method"], case["batch"], case["heads"],
                                                                  case["seq_len"], case["head_dim"], cp=cp), case
            assert result["backward_bytes"] == expected.backward, case
            forward, backward = result["calls"]["forward"], result["calls"]["backward"]
            if case["method"] == "ring":   # one stacked K/V message per step; dK/dV one more step
                assert forward == {"send": (cp - 1, forward["send"][1]), "recv": (cp - 1, forward["send"][1])}
                assert backward["send"][0] == (cp - 1) + cp
            else:                          # q, k, v in one all-to-all, the output in another
                assert forward["all_to_all"][0] == 2 and backward["all_to_all"][0] == 2
                assert "send" not in forward


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_causal_work_and_the_contiguous_split_does_not(on_ranks, cp):
    results = on_ranks[cp][0]
    work = {layout: [next(r["work"] for r in found if r["case"]["seq_len"] == 128 and r["case"]["layout"] == layout)
                     for found in results] for layout in ("contiguous", "zigzag")}
    zigzag = [w["entries"] for w in work["zigzag"]]
    assert max(zigzag) <= 1.10 * min(zigzag), zigzag
    useful = [w["allowed"] for w in work["contiguous"]]
    assert useful == sorted(useful)                                     # later ranks, more work
    assert max(useful) / min(useful) == pytest.approx(2 * cp - 1, rel=0.10), useful
    computed = [w["entries"] for w in work["contiguous"]]
    assert max(computed) / min(computed) > 0.8 * (2 * cp - 1), computed
    # the same causal triangle, only spread differently
    assert sum(w["allowed"] for w in work["zigzag"]) == sum(useful) == 128 * 129 // 2


def test_a_peer_that_never_answers_times_out_naming_the_rank():
    messages = launch(stalled_peer_check, 2, ["ring", "ulysses"], 1.0, backend="gloo", timeout=60,
                      startup_timeout=120)
    assert messages[1] == []
    ring, ulysses = messages[0]
    assert ring.startswith("rank 0 (cp index 0 of 2): forward step 0: the key/value block from rank 1"), ring
    assert ulysses.startswith("rank 0 (cp index 0 of 2): sequence → heads all-to-all"), ulysses
    assert all("timeout=1 s" in m for m in messages[0])


# --- the one GPT-2 with ring attention -----------------------------------------------------------

def test_gpt2_with_ring_attention_equals_the_dense_model(on_ranks):
    """Logits of each rank's tokens, the loss, and every parameter's gradient summed over cp (both layouts)."""
    for rank, (found, *_) in enumerate(on_ranks[2][1]):
        assert set(found) == {"contiguous", "zigzag"}
        for layout, errors in found.items():
            for name, error in errors.items():
                assert error < ATOL, f"rank {rank}, {layout}: {name} differs by {error:.2e}"


def test_parallelize_cp_refuses_what_it_cannot_run(one_rank_group):
    world = dist.group.WORLD
    with pytest.raises(TypeError, match="model must be the one GPT2"):
        parallelize_cp(torch.nn.Linear(2, 2), world)
    with pytest.raises(ValueError, match=r"needs dropout off: config.attn_pdrop=0.1"):
        parallelize_cp(build_model("tiny", 64, attn_pdrop=0.1), world)
    with pytest.raises(ValueError, match="not context-parallel: call parallelize_cp"):
        cp_shard(build_model("tiny", 64), torch.zeros(1, 8, dtype=torch.long))
    model = parallelize_cp(build_model("tiny", 64), world, block=4)
    with pytest.raises(ValueError, match="already context-parallel"):
        parallelize_cp(model, world)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="attention_mask \\(padding\\) is not supported"):
        model(ids, attention_mask=torch.ones(2, 8))
    my_ids, positions = cp_shard(model, ids)   # one rank: the whole sequence, and the dense model's logits
    torch.testing.assert_close(model(my_ids, positions=positions), build_model("tiny", 64)(ids), rtol=0, atol=ATOL)


def test_cp_times_dp_trains_like_one_process(on_ranks):
    """Mesh(dp=2, cp=2): 3 AdamW steps of GPT-2 with ring attention (zig-zag) against one process."""
    for rank, (found, *_) in enumerate(on_ranks[4][1]):
        assert found["loss"] < ATOL, (rank, found)
        # AdamW turns gradient differences of ~1e-8 into updates of up to lr on near-zero gradients
        assert found["parameters"] < 3e-4, (rank, found)


def cp_tp_training(rank: int, world_size: int, steps: int = 3, seq_len: int = 32, vocab: int = 64) -> float:
    """A rank's worker: Mesh(tp=2, cp=2), parallelize_tp then parallelize_cp, AdamW steps; gathered parameters'
    largest difference from one process trained on the same batches (the TP layers are kept by the CP swap)."""
    from parallel_lib.context_parallel import shard_sequence
    from parallel_lib.runtime.mesh import Mesh
    from parallel_lib.tensor_parallel import gather_dense, parallelize_tp

    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, vocab, (1, seq_len), generator=gen),
                torch.randint(0, vocab, (1, seq_len), generator=gen)) for _ in range(steps)]

    def loss_of(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    dense = build_model("tiny", vocab, seed=0)
    optimizer = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    for ids, labels in batches:
        optimizer.zero_grad()
        (loss_of(dense(ids), labels) / labels.numel()).backward()
        optimizer.step()
    with Mesh(tp=2, cp=world_size // 2).build(timeout=60.0) as pm:
        model = parallelize_tp(build_model("tiny", vocab, seed=0), pm, vocab_parallel=False)
        parallelize_cp(model, pm, layout="zigzag", block=8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for ids, labels in batches:
            optimizer.zero_grad()
            my_ids, positions = cp_shard(model, ids)
            my_labels = shard_sequence(labels, pm.size("cp"), pm.index("cp"), "zigzag", dim=1)
            (loss_of(model(my_ids, positions=positions), my_labels) / labels.numel()).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=pm.group("cp"))
            optimizer.step()
        trained = gather_dense(model).state_dict()
    expected = dense.state_dict()
    return max(float((trained[k] - expected[k]).abs().max()) for k in expected)


def test_cp_times_tp_trains_like_one_process(on_ranks):
    """Mesh(tp=2, cp=2): tensor-parallel GPT-2 (heads split) whose attention is then swapped for the ring."""
    for rank, (_, worst, *_) in enumerate(on_ranks[4][1]):
        # measured 1.3e-4: AdamW turns ~1e-8 gradient differences into updates of up to lr (1e-2) where a
        # gradient is near zero; without the gradients' all-reduce over cp the difference is 6e-2
        assert worst < 5e-4, (rank, worst)


def test_pytorch_context_parallel_beside_ours(on_ranks):
    """Where PyTorch's context_parallel runs, it agrees with attention and with ours on the same inputs; on a CPU it
    refuses, for a named reason. Ours, on those inputs (zig-zag ring, outputs gathered), equals SDPA either way."""
    for _, theirs, *_ in on_ranks[2][1]:
        assert theirs["ours"] < ATOL, theirs
        if theirs["ran"]:
            assert theirs["output"] < ATOL and theirs["beside_ours"] < ATOL, theirs
        else:  # its dispatcher intercepts the CUDA kernels only; the CPU kernel has no sharding rule
            assert "_scaled_dot_product_flash_attention_for_cpu" in theirs["error"], theirs["error"]
            assert theirs["error"] == ("NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu"
                                       ".default does not have a sharding strategy registered."), theirs["error"]


def test_measurements_report_the_census_the_work_and_the_bytes(on_ranks):
    here = measure_one_process(MEASURED, MEASURE_SHAPE)
    assert [(m.method, m.seq_len) for m in here] == [("full", 32), ("tiled", 32), ("full", 64), ("tiled", 64)]
    for m in here:
        assert m.saved_bytes == (attention_saved_bytes(m.method, 1, 4, m.seq_len, 8, causal=True),)
        assert m.seconds[0] > 0 and m.wire_bytes == (0.0,)
    runs = [found[2] for found in on_ranks[2][1]]   # each rank's list of runs
    assert len(runs[0]) == len(MEASURED) * 3
    for i, first in enumerate(runs[0]):
        ranks = [r[i] for r in runs]
        method, s = first["method"], first["seq_len"]
        assert all(r["saved_bytes"] == attention_saved_bytes(method, 1, 4, s, 8, cp=2) for r in ranks)
        assert all(r["wire_bytes"] == cp_wire_bytes(method, 1, 4, s, 8, 2).total for r in ranks)
        if first["layout"] == "zigzag":
            assert len({r["tiles"] for r in ranks}) == 1
    with pytest.raises(ValueError, match="divisible by 2·cp = 8, got seq_len=36"):
        measure_context([32, 36], cps=(4,))


def test_memory_per_rank_by_census_is_within_5_percent_of_the_formula_at_every_length(on_ranks):
    """Item 1 of the chapter: what each rank keeps for backward (autograd's saved tensors, counted) against sequence
    length, for full and tiled attention in one process and ring (both layouts) and Ulysses at cp 2 and 4."""
    b, n, d = MEASURE_SHAPE.batch, MEASURE_SHAPE.heads, MEASURE_SHAPE.head_dim
    lengths = MEASURED + [128]
    rows = [vars(m) for m in measure_one_process(lengths, MEASURE_SHAPE)]
    rows += rank_rows([found[2] for found in on_ranks[2][1]], 2) + rank_rows([found[2] for found in on_ranks[4][1]], 4)
    census = {}
    for row in rows:
        formula = attention_saved_bytes(row["method"], b, n, row["seq_len"], d, causal=True, cp=row["cp"])
        for rank, kept in enumerate(row["saved_bytes"]):
            assert kept == pytest.approx(formula, rel=0.05), (row["method"], row["layout"], row["cp"], rank)
        census[row["method"], row["layout"], row["cp"], row["seq_len"]] = max(row["saved_bytes"])
    assert {(m, layout, cp) for m, layout, cp, _ in census} == {
        ("full", "-", 1), ("tiled", "-", 1), ("ring", "contiguous", 2), ("ring", "zigzag", 2),
        ("ulysses", "contiguous", 2),
        ("ring", "contiguous", 4), ("ring", "zigzag", 4), ("ulysses", "contiguous", 4)}
    # measured, not assumed: full attention's memory grows with s², the others' with s; cp ranks share it
    assert census["full", "-", 1, 128] / census["full", "-", 1, 64] == pytest.approx(4, rel=0.01)
    for key in (("tiled", "-", 1), ("ring", "zigzag", 2), ("ulysses", "contiguous", 4)):
        assert census[(*key, 64)] / census[(*key, 32)] == pytest.approx(2, rel=0.05), key
    assert census["ring", "zigzag", 2, 64] / census["ring", "zigzag", 4, 64] == pytest.approx(2, rel=0.01)
    assert census["tiled", "-", 1, 64] / census["ring", "contiguous", 4, 64] == pytest.approx(4, rel=0.01)


# --- one rank, and bad input ----------------------------------------------------------------------

@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention])
def test_one_rank_is_plain_attention(one_rank_group, attention):
    q, k, v, upstream = (torch.randn(1, 2, 16, 4) for _ in range(4))
    expected = _grads(full_attention, q, k, v, upstream, causal=True)
    actual = _grads(attention, q, k, v, upstream, group=dist.group.WORLD, causal=True, block=4)
    for name, got, want in zip(("output", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_bad_context_parallel_input_is_refused(one_rank_group):
    q = torch.randn(1, 2, 8, 4)
    world = dist.group.WORLD
    with pytest.raises(TypeError, match=r"group must be the context-parallel group \(mesh.group\('cp'\)\)"):
        ring_attention(q, q, q, None)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, world, layout="striped")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ulysses_attention(q, q, q, world, timeout=0)
    with pytest.raises(ValueError, match="s/cp must be even"):
        ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], world)
    with pytest.raises(ValueError, match="same tokens"):
        ring_attention(q, q[:, :, :4], q[:, :, :4], world)
    with pytest.raises(ValueError, match=r"heads=12 is not divisible by cp=8; use cp in \[1, 2, 3, 4, 6, 12\]"):
        check_ulysses(12, 8)
    with pytest.raises(ValueError, match="method must be one of"):
        cp_wire_bytes("tree", 1, 2, 8, 4, 2)
    with pytest.raises(ValueError, match="seq_len must be divisible by cp"):
        cp_wire_bytes("ring", 1, 2, 9, 4, 2)
    with pytest.raises(ValueError, match="runs on one rank: pass cp=1"):
        attention_saved_bytes("tiled", 1, 2, 8, 4, cp=2)
    with pytest.raises(ValueError, match="heads=2, cp=4"):
        attention_saved_bytes("ulysses", 1, 2, 8, 4, cp=4)
    with pytest.raises(ValueError, match="layout must be one of"):
        Case(layout="striped")


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_step_record_replays_to_every_block_everywhere_and_every_gradient_home(on_ranks, cp):
    """From the ranks' own step records: forward, each rank sees every block once, handed on by its left
    neighbour; backward, each block's dK/dV accumulator visits all cp ranks and ends at the block's owner."""
    for case_index, case in enumerate(on_ranks[cp][0][0]):
        if case["case"]["method"] != "ring":
            continue
        events = {(e["direction"], e["step"], e["rank"]): e for found in on_ranks[cp][0]
                  for e in found[case_index]["record"]}
        assert len(events) == cp * cp + cp * (cp + 1)
        for r in range(cp):
            assert sorted(events["forward", t, r]["block"] for t in range(cp)) == list(range(cp))
            for t in range(1, cp):   # the block in hand is the one the left neighbour held a step before
                assert events["forward", t, r]["block"] == events["forward", t - 1, (r - 1) % cp]["block"]
                assert "kv" in events["forward", t - 1, (r - 1) % cp]["sends"]
            work = on_ranks[cp][0][r][case_index]["work"]
            assert sum(events["forward", t, r]["tiles"] for t in range(cp)) == work["tiles"]
            for t in range(cp):      # backward recomputes exactly forward's tiles
                assert events["backward", t, r]["tiles"] == events["forward", t, r]["tiles"]
        contributors = {}            # rank -> (block, ranks whose queries added to its dK/dV) finished last step
        for t in range(cp + 1):
            finished = {}
            for r in range(cp):
                left, event = (r - 1) % cp, events["backward", t, r]
                incoming = contributors[left] if "dkv" in events["backward", t, left]["sends"] else None
                if t == cp:          # the home step: my own block's accumulator, from every rank
                    assert incoming == (r, set(range(cp))), (t, r, incoming)
                    continue
                if incoming is not None:
                    assert incoming[0] == event["block"], (t, r)
                finished[r] = (event["block"], (incoming[1] if incoming else set()) | {r})
            contributors = finished
