"""Where activations come from: a runner GPT or a transformers model, files, synthetic data, the cache."""
