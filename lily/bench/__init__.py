"""Benchmarks: ``lily bench`` (prefill/decode sweep against peers), ``lily compare``
(numerical consistency against a reference engine) and the GPU scripts of ``gpu``
(``lily bench --run NAME``).

Modules: ``random_model`` (full-size random weights built on the device), ``measure``
(ceilings, cost model, environment, expert load), ``sweep`` (timing loop and budgets),
``peers`` (MLX-LM and transformers in worker processes), ``compare``, ``report`` (JSON,
Markdown, PNG), ``kernels`` (runs and merges the kernel benchmarks), ``gpu`` and ``cli``.
"""
