"""Tensor parallelism (chapter 07): Megatron's column/row layers from all-reduce, GPT-2 split by heads."""
