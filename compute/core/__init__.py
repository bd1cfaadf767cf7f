"""Torch-free core of stage 2: scheduling, KV block bookkeeping, sequences, records."""
