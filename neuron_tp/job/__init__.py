"""What the training, generation, serving and planning jobs share: their configs
(:mod:`.config`), the model presets, the one tokenizer rule (:mod:`.tokenizer`), training data
(text streams and instruction samples, chat templates, packing into rows, tables, the
tokenized-data cache) and the per-rank runtime."""
