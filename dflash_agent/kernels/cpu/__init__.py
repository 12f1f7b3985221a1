"""The CPU kernels: C sources and their ABI header, the ctypes loader (cpu_dot) and the builder (build)."""
