"""Subprocess entry points for tests that need a second, unrelated process."""
