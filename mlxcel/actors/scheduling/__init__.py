"""Pure, synchronous scheduling policy: no Trio, no mlx, unit-tested on its own."""
