"""Decoding images within a memory budget: the worker pool, headers and pixels, query boxes, capture times."""
