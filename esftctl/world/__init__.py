"""The tiny MoE world: synthetic tasks, a tokenizer and small MoE models, all built offline from seeds."""
