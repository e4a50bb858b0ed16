"""Benchmarks (kernel microbenchmarks); speed claims live here and in scripts/, never in unit tests."""
