"""Where large models are trained: adapters for torchtitan and Hugging Face (issue 33).

Nothing here is imported by ``torch_impl`` itself unless asked for; each module imports its
engine lazily, so the library keeps needing numpy and torch only."""
