"""attnopt's FX passes, one per file, run in the order given in :mod:`attnopt.pipeline`."""
