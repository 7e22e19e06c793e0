"""Hostile clients and users: bad input, fuzzing, floods, other uids, memory pulled away, sizes."""
