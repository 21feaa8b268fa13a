"""Benchmark pieces: workloads, runners (our engine, transformers), and the report."""
