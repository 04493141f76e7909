"""Compiled kernels shared by decoders and transforms (private; imports Numba, so import lazily)."""
