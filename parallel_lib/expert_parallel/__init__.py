"""Chapter 12: mixture of experts and expert parallelism (layer 3).

- :mod:`.router`: top-k of a softmax over experts;
- :mod:`.capacity`: slots per expert, and which choices are dropped;
- :mod:`.balance`: the auxiliary load-balancing loss, tokens per expert and per rank;
- :mod:`.expert`: one expert, GPT-2's MLP shape;
- :mod:`.moe`: the layer in one process (the reference), a drop-in for GPT-2's MLP;
- :mod:`.uneven_all_to_all`: the counts exchange and the differentiable all-to-all with uneven splits;
- :mod:`.expert_compute`: a rank's experts on their rows, looped or in one grouped multiply;
- :mod:`.expert_parallel_moe`: the layer with its experts spread over the mesh's ``ep`` axis;
- :mod:`.traffic`: the bytes its all-to-alls move;
- :mod:`.parallelize`: the one GPT-2 with mixture MLPs, and its experts spread over ``ep``;
- :mod:`.routing_log`: tokens per expert and per rank, and step times, logged while training on ranks;
- :mod:`.verify`: checks that run on ranks, against the one-process layer.
"""

from parallel_lib.expert_parallel.uneven_all_to_all import AllToAll, all_to_all, exchange_counts
from parallel_lib.expert_parallel.balance import imbalance, load_balancing_loss, tokens_per_expert, tokens_per_rank
from parallel_lib.expert_parallel.capacity import expert_capacity, keep_within_capacity
from parallel_lib.expert_parallel.expert import Expert
from parallel_lib.expert_parallel.expert_compute import EXPERT_COMPUTE, run_experts, time_expert_compute
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, expert_parameters, sync_ep_grads
from parallel_lib.expert_parallel.moe import MoE, MoEConfig, RoutingRecord, aux_loss_of, route_tokens
from parallel_lib.expert_parallel.parallelize import ep_group_of, moe_gpt2, parallelize_ep
from parallel_lib.expert_parallel.routing_log import load_by_step, log_routing
from parallel_lib.expert_parallel.router import Router, Routing, top_k_route
from parallel_lib.expert_parallel.traffic import EPTraffic, ep_traffic, rows_leaving

__all__ = ["Routing", "Router", "top_k_route", "expert_capacity", "keep_within_capacity", "load_balancing_loss",
           "tokens_per_expert", "tokens_per_rank", "imbalance", "Expert", "MoEConfig", "RoutingRecord", "MoE",
           "route_tokens", "aux_loss_of", "exchange_counts", "all_to_all", "AllToAll", "ExpertParallelMoE",
           "sync_ep_grads", "expert_parameters", "EPTraffic", "ep_traffic", "rows_leaving", "moe_gpt2",
           "EXPERT_COMPUTE", "run_experts", "time_expert_compute",
           "parallelize_ep", "ep_group_of", "log_routing", "load_by_step"]
