"""What the training, generation and planning jobs share: their configs, the model
presets, tokenizers and data, the per-rank runtime."""
