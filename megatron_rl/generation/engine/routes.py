"""What :class:`~.server.EngineServer` provides to the route groups it is built from.

The weight-update routes (``updates.py``) and the colocated-mode routes (``colocate.py``) are
mixins of the server: each declares the server's attributes it reads, and both call the two
services declared here -- the engine lock, taken between two engine steps, and aborting every
request. One base says them once, so mypy checks every call and the server overrides both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

__all__ = ["ServerServices"]


class ServerServices:
    """The engine server's services that its route mixins call; the server overrides both."""

    def _between_steps(self) -> AbstractContextManager[None]:
        """The engine lock, taken before the engine's next step."""
        raise NotImplementedError("EngineServer provides _between_steps")

    def _abort_all(self) -> int:
        """Abort every queued and running request; how many."""
        raise NotImplementedError("EngineServer provides _abort_all")
