"""The Kronecker engine MKOR and K-FAC share (``torch_impl/kronecker/``), each test run on both
methods: discovery and layer types, the capture (pairing, token masks, checkpointing, compile,
the self-check), fused experts (transformers' and torchtitan's), the ``torch.optim`` surface
(GradScaler, step hooks, copies, ``init_state``), real models and training loops."""
