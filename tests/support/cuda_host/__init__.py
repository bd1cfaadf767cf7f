"""Host (CPU) emulation of the CUDA kernels, for tests/kernels/test_kernels_gpu.py."""
