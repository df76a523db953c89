"""The model runner: one thread owns the model and every mlx object (see runner.py)."""
