"""The whole suite's setup: rsmem is imported before any test module imports torch, as a program using
rsmem should, so OpenMP's wait policy and thread choice (rsmem.threads) are the same whichever tests run."""

import rsmem  # noqa: F401  # isort: skip
