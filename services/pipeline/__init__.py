"""The serving pipeline: the tokenize, engine and output stages and their request state."""
