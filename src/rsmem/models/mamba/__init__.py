"""The Mamba family: Mamba (``mamba1``) and Mamba-2 (``mamba2``) on their shared base (``base``), and
random weights for tests and benchmarks (``random_init``)."""
