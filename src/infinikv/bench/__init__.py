"""Benchmarks: speed and memory, always as ratios to ``full`` measured in the same run."""
