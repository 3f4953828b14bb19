"""The encoder wing: GPU OMP over a dictionary (tiled and vector kernels) and the
per-device choice between it and the CPU codec."""
