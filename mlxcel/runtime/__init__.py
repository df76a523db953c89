"""The actor kernel: messages, errors, settings, the root system. No HTTP and no mlx here."""
