"""Triton kernels of agspec_gpu, installed as ``agspec_gpu.kernels``.

Each module holds a private ``_name_kernel`` and one launcher that validates, allocates and
launches. Kernels import nothing from the library.
"""
