"""DDP and FSDP2 on forked gloo ranks, against the single-process run."""
