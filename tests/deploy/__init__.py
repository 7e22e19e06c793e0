"""The shipped deployment: its artefacts checked by operators' tools, and started as shipped."""
