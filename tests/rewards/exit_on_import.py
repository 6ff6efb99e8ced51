"""Preloaded by a verifier pool's forkserver in a test: every process forked from the server dies
at once, as workers do when their start-up is broken (e.g. an unimportable main module)."""

import os

os.register_at_fork(after_in_child=lambda: os._exit(17))
