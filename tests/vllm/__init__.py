"""The vLLM connector: its halves on a real daemon, vLLM's layouts and configs, real engines."""
