"""The one GPT-2 every strategy composes (layer 2): Hugging Face's names and layout, swappable parts.

- :mod:`.linear`: ``Conv1D``, GPT-2's (in, out) linear layer;
- :mod:`.dropout`: dropout keyed by (seed, call, site), drawn on the activation's device;
- :mod:`.attention`: causal self-attention with an optional KV cache, and the mask it reads;
- :mod:`.mlp`: the feed-forward part;
- :mod:`.gpt2`: blocks, body, head, the model and its initialisation;
- :mod:`.hf`: to and from Hugging Face's ``GPT2LMHeadModel`` (exact).
"""

from parallel_lib.models.attention import CausalSelfAttention, KVStore, allowed_keys
from parallel_lib.models.dropout import DropoutStream, SeededDropout
from parallel_lib.models.gpt2 import GPT2, Block, GPT2Transformer, LMHead, build_model, check_config, init_weights
from parallel_lib.models.hf import as_gpt2, from_hf, to_hf
from parallel_lib.models.linear import Conv1D
from parallel_lib.models.mlp import MLP

__all__ = ["Conv1D", "DropoutStream", "SeededDropout", "KVStore", "allowed_keys", "CausalSelfAttention", "MLP",
           "Block", "GPT2Transformer", "LMHead", "GPT2", "check_config", "build_model", "init_weights",
           "from_hf", "to_hf", "as_gpt2"]
