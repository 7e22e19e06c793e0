"""The engine's side: the clients' transports, and the README's example run as written."""
