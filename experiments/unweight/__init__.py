"""Experiments on the Unweight codec: compression, decoding, loading."""
