"""One daemon serving real clients: moves, the prefix cache, completions, metrics, faults, load."""
