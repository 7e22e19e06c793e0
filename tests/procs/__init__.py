"""Child processes of the tests: each module is run as ``python -m tests.procs.<name>``."""
