"""The model runner: a step's flat batch, forward and sampling, fault isolation, CUDA graphs."""
