"""The model: the decoder every family runs, its mixture-of-experts MLP, RoPE frequencies."""
