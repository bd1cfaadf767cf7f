"""Device, thread and allocator policy: compute/device/selection.py applies it."""
