"""What both families share: hyperparameter validation, tensor helpers (foreach, complex views,
norms), matrix functions (Newton-Schulz) and the FSDP2 sharding checks."""
