"""What the daemon lets each sender do, and how much of it at once.

- `access`: who may touch what (principals, engine ownership, `authorize`).
- `admission`: how many copy jobs may be queued or running, per worker, per user and in all.
- `connections`: connections counted per process and per user, refused past the limits.
"""
