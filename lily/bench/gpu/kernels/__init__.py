"""Kernel benchmarks: each kernel family checked against the reference and timed at the
model's shapes, with its floors; tile sweeps."""
