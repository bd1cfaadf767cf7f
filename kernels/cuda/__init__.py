"""The CUDA kernels in kernels/csrc: ``launch`` compiles and launches them through CuPy,
``checks`` validates what they are given, ``attention_plan`` sizes the decode partitions."""
