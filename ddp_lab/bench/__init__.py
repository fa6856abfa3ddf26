"""Benchmarks that measure the seed articles' claims and our own collectives and loop."""
