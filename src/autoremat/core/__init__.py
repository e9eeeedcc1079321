"""Shared helpers every stage uses: tensors nested in values, sizes and budgets, plan entries,
the classes autoremat swaps in, selective recompute's op lists, Hugging Face caches, clocks
and devices. Nothing here runs a model."""
