"""Runnable examples, e.g. ``torchrun --nproc_per_node 2 -m torch_impl.examples.ddp_mkor``."""
