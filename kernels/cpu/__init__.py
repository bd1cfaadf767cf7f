"""The C++ CPU kernels: ``build`` compiles kernels/csrc/cpu once per machine and ISA,
``library`` loads it; one launcher module per C++ file (``quant_linear``, ``attention``,
``elementwise``, ``moe``, ``decoder``) calls it through ctypes on torch tensors; ``quant``
holds the weights' block formats."""
