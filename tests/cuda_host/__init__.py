"""Host (CPU) emulation of the CUDA kernels, for tests/test_kernels_gpu.py."""
