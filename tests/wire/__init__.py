"""What both ends of a socket share: the protocol's messages, id frames, non-blocking ZMQ I/O."""
