"""The Triton kernels and their launch helpers, imported only where they run (a CPU-only install may lack Triton);
kernels.attention and kernels.dispatch, one level up, choose when they run."""
