"""The C++ CPU kernels: ``build`` compiles kernels/csrc/cpu once per machine and ISA,
``launch`` calls them through ctypes on torch tensors."""
