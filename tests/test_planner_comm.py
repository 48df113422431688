"""What the planners charge for communication (issue #21, errors 6, 7 and 4), against literals.

- 6: full recomputation repeats the blocks' forward, their tensor-parallel all-reduces included (the
  counter of a real run agrees: ``test_tensor_parallel.test_gpt2_logits_loss_and_gradients_equal_dense``);
- 7: each group is priced on the link it crosses: a tp group of 8 or 8 replicas on one node on NVLink
  (NVIDIA's H100 SXM: 900 GB/s both ways, 450 GB/s per direction), a group spanning nodes on
  InfiniBand (one 400 Gb/s NDR adapter per GPU, 50 GB/s);
- 4: what the engines overlap (DDP's buckets with backward, ZeRO-3's prefetch of the next layer)
  shows only beyond the compute it hides behind (at least one piece); tensor parallelism's
  all-reduces never hide.
"""

from __future__ import annotations

import pytest

from parallel_lib.common.models import build_gpt2, count_parameters
from parallel_lib.planner.calibrate import KINDS, AlphaBeta, Calibration, RankSpeed
from parallel_lib.planner.hardware import Links, group_span, published_calibration
from parallel_lib.planner.layout import Layout, StepCost, exposed_seconds, price
from parallel_lib.planner.strategy import plan
from parallel_lib.cost.shape import GPTShape

MODEL = build_gpt2("tiny", vocab_size=512, seed=0, n_positions=64)
SHAPE = GPTShape.of(MODEL.config)  # 4 blocks, width 64
LINK = AlphaBeta(1e-4, 1e9)
CAL = Calibration("synthetic", {1: RankSpeed(1, 1e10, 1e10, {k: LINK for k in KINDS}),
                                4: RankSpeed(4, 1e10, 1e10, {k: LINK for k in KINDS})})
COST = StepCost(1e-3, 1e10, 2e-3)


def test_recomputation_pays_the_recomputed_forwards_tensor_parallel_all_reduces():
    plain = price(Layout(tp=2), SHAPE, 16, 64, CAL, COST)
    recomputed = price(Layout(tp=2, recompute=True), SHAPE, 16, 64, CAL, COST)
    # per block 2 all-reduces more, each of 16 x 64 x 64 fp32 = 262,144 bytes: 2 ring steps of 100 µs and
    # 2 (t - 1) / t x 262,144 = 262,144 bytes at 1 GB/s
    one = 2 * 1e-4 + 262_144 / 1e9
    assert recomputed.tp_comm - plain.tp_comm == pytest.approx(4 * 2 * one, rel=1e-12)


def test_a_group_spans_its_size_times_the_faster_axes():
    sizes = dict(tp=8, pp=2, dp=4)
    assert group_span("tp", sizes) == 8 and group_span("pp", sizes) == 16 and group_span("dp", sizes) == 64
    assert group_span("dp", dict(tp=2, dp=4)) == 8                   # 4 replicas of tp 2: one node
    assert group_span("pp", sizes, order="tp-dp-pp") == 64           # Megatron's order: pp slowest
    with pytest.raises(ValueError, match="axis must be one of"):
        group_span("xp", sizes)


def test_links_of_an_h100_node_are_nvlink_inside_and_infiniband_across():
    links = Links.of("H100")
    assert (links.bandwidth(8), links.bandwidth(16)) == (450e9, 50e9)
    assert links.describe(8) == "NVLink, 450 GB/s" and links.describe(9) == "InfiniBand, 50 GB/s"
    with pytest.raises(ValueError, match="inside must be > 0"):
        Links(0.0, 50e9)


def test_chapter_05s_planner_prices_a_node_on_nvlink_and_nodes_on_infiniband():
    # LLaMA-2-7B, fp16; DP x PP = 2 replicas of 4 stages on one node of 8. The last stage is the busiest: 8 blocks
    # of 202,383,360 (matrices and two RMSNorm weights), the final norm (4096) and the untied head (32,000 x 4096)
    one_node = plan("llama-2-7b", 4096, 64, 80, 8).option("DP×PP")
    assert (one_node.replicas, one_node.stages, one_node.micro_batches) == (2, 4, 16)
    params = 8 * 202_383_360 + 4096 + 32_000 * 4096
    assert one_node.priced.params == params == 1_750_142_976
    # ring all-reduce of its fp16 gradients over 2 replicas on NVLink: 2 steps of 5 µs, 2 x 1/2 x 2 bytes x params
    assert one_node.allreduce_bytes == 2 * params
    dp = one_node.priced.dp_comm + one_node.priced.dp_hidden
    assert dp == pytest.approx(2 * 5e-6 + 2 * params / 450e9, rel=1e-12)
    # an inner stage sends 16 micro-batches' (2 x 4096 x 4096) fp16 hidden states forward and their gradients back
    boundary = 2 * 4096 * 4096 * 2
    assert one_node.p2p_bytes == 2 * 16 * boundary == 2_147_483_648
    assert one_node.priced.pp_comm == pytest.approx(32 * (5e-6 + boundary / 450e9), rel=1e-12)
    assert one_node.comm_seconds == pytest.approx(dp + one_node.priced.pp_comm, rel=1e-12)
    # 16 GPUs: the 8 replicas' group spans two nodes (InfiniBand), each 2-stage pipeline stays on one (NVLink)
    two_nodes = plan("llama-2-7b", 4096, 64, 80, 16).option("DP×PP")
    assert (two_nodes.replicas, two_nodes.stages) == (8, 2)
    params = 16 * 202_383_360 + 4096 + 32_000 * 4096  # the last of 2 stages
    dp = two_nodes.priced.dp_comm + two_nodes.priced.dp_hidden
    assert dp == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * 2 * params / 50e9, rel=1e-12)  # 14 ring steps of 10 µs
    boundary = 4096 * 4096 * 2  # 8 micro-batches of one sequence; an end stage sends one way
    assert two_nodes.priced.pp_comm == pytest.approx(8 * (5e-6 + boundary / 450e9), rel=1e-12)
    assert "gradients on InfiniBand, 50 GB/s; hidden states on NVLink, 450 GB/s" in "\n".join(two_nodes.reasons)


def test_the_calibrated_planner_puts_tp_8_on_nvlink_and_dp_across_nodes_on_infiniband():
    # tp = 8 on one node, dp = 2 over two nodes; one block, no overlap: the sums are the α-β's literals
    shape = GPTShape(1, 1024, 8, 8192, 1024)
    priced = price(Layout(dp=2, tp=8, dtype="bf16"), shape, 2, 1024, published_calibration("H100"),
                   StepCost(0.0, 989e12), overlap=False)
    act = 1 * 1024 * 1024 * 2  # one sequence's (s, h) in bf16 per all-reduce
    # 4 of a block + embedding + head input (all act bytes) and the loss's 3 of s fp32 values, 14 ring steps of 5 µs
    tp = 6 * (14 * 5e-6 + 2 * 7 / 8 * act / 450e9) + 3 * (14 * 5e-6 + 2 * 7 / 8 * 1024 * 4 / 450e9)
    assert priced.tp_comm == pytest.approx(tp, rel=1e-9)
    grads = priced.params * 2  # bf16 gradients, one all-reduce over 2 replicas: 2 ring steps of 10 µs
    assert priced.dp_comm == pytest.approx(2 * 10e-6 + grads / 50e9, rel=1e-12)


def test_exposed_communication_is_what_outlasts_the_compute_beside_it():
    assert exposed_seconds(1.0, 10.0, 1) == 1.0   # one bucket: ready when the backward ends, nothing hidden
    assert exposed_seconds(1.0, 10.0, 4) == 0.25  # short buckets: only the last shows
    assert exposed_seconds(8.0, 4.0, 4) == 5.0    # long ones: 8 - 4 x 3/4 of the compute hides
    with pytest.raises(ValueError, match="pieces must be an int >= 1"):
        exposed_seconds(1.0, 1.0, 0)


# 10 ms per block and micro-batch pass, FLOPs free: tiny's 4 blocks + embedding and head (half a block each) make
# a forward of 50/3 ms and a backward of 100/3 ms; 5 pieces (a bucket or layer group per block, one for the rest)
SLOW = StepCost(0.01, 1e30)
FORWARD, BACKWARD, PIECES = 0.05 / 3, 0.1 / 3, 5


def test_dp_gradients_hide_behind_the_backward_but_its_last_bucket():
    plain = price(Layout(dp=4), SHAPE, 16, 64, CAL, SLOW, overlap=False)
    hidden = price(Layout(dp=4), SHAPE, 16, 64, CAL, SLOW, overlap=True)
    comm = 6 * 1e-4 + 1.5 * count_parameters(MODEL) * 4 / 1e9  # ring all-reduce over 4: 6 steps, 1.5 x the bytes
    assert plain.dp_comm == pytest.approx(comm, rel=1e-12) and plain.dp_hidden == 0.0
    assert comm / PIECES > comm - BACKWARD * 4 / 5  # the buckets are short: only the last one shows
    assert hidden.dp_comm == pytest.approx(comm / PIECES, rel=1e-12)
    assert hidden.dp_hidden == pytest.approx(comm * 4 / 5, rel=1e-12)
    assert hidden.step_seconds == pytest.approx(plain.step_seconds - comm * 4 / 5, rel=1e-12)
    # this machine's calibration stands for the course's engines (after the backward, no prefetch): no overlap
    assert price(Layout(dp=4), SHAPE, 16, 64, CAL, SLOW).dp_hidden == 0.0


def test_zero_3_prefetch_hides_gathers_behind_each_pass_and_tp_hides_nothing():
    slow_link = Calibration("synthetic", {1: CAL.ranks[1], 4: RankSpeed(4, 1e10, 1e10, {k: AlphaBeta(0.0, 2e7)
                                                                                       for k in KINDS})})
    priced = price(Layout(dp=4, zero=3), SHAPE, 16, 64, slow_link, SLOW, overlap=True)
    group = count_parameters(MODEL) * 4 / PIECES  # 5 equal flat groups, fp32
    gather = PIECES * 0.75 * group / 2e7          # one pass's all-gathers: (N - 1)/N of each group at 20 MB/s
    scatter = PIECES * 0.75 * group / 2e7         # the reduce-scatter of the gradients, as much
    expected = max(gather / 5, gather - FORWARD * 4 / 5) + max((gather + scatter) / 5,
                                                                gather + scatter - BACKWARD * 4 / 5)
    assert priced.dp_comm == pytest.approx(expected, rel=1e-12)
    assert priced.dp_comm + priced.dp_hidden == pytest.approx(2 * gather + scatter, rel=1e-12)
    tp = Layout(dp=2, tp=2)  # the tensor-parallel all-reduces are on the critical path: never hidden
    on, off = (price(tp, SHAPE, 16, 64, CAL, SLOW, overlap=flag) for flag in (True, False))
    assert on.tp_comm == off.tp_comm > 0 and on.compute == off.compute


def test_links_are_a_calibration_of_published_figures_for_chapter_05s_planner():
    pcie = Links(25e9, 12.5e9, 8, "PCIe", "Ethernet").calibration()
    # inside a node of 8: the links' own speed with NVLink's 5 µs a ring step; 9 ranks wide: the network's, 10 µs
    assert pcie.link("all_reduce", 16, 8) == AlphaBeta(5e-6, 25e9)
    assert pcie.link("all_reduce", 16, 9) == AlphaBeta(10e-6, 12.5e9)
    assert pcie.ranks[1].flops_per_second == 989e12  # computing at an H100's published peak unless told
    assert published_calibration("A100").link("send", 64, 16) == AlphaBeta(10e-6, 25e9)  # DGX A100: HDR, 25 GB/s
    with pytest.raises(ValueError, match="gpu must be one of"):
        Links(25e9, 12.5e9, gpu="H200")
