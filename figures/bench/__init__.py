"""Benchmarks against torch.optim, measured in the same run (``python -m figures.bench``):
the optimizer step, MKOR's factor update, Hugging Face models, and step memory."""
