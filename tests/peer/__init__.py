"""Pulls between engines and between daemons: plans, the ZMQ and NIXL planes, the producer."""
