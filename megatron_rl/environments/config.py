"""``env.*``: the multi-turn environment of a recipe (see :mod:`megatron_rl.environments`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import ConfigFieldError, check_range

__all__ = ["EnvConfig"]


@dataclass(kw_only=True)
class EnvConfig:
    """The environment a trajectory talks to; ``custom: null`` keeps the loop single-turn."""

    custom: str | None = None  # module:Class of the environment, or "python" (the built-in Python tool)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the class
    max_turns: int = 4  # model turns per trajectory (the last one is not answered)
    max_tokens: int = 1024  # tokens after the prompt, model and environment together
    step_timeout_s: float = 10.0  # limit of each reset / step / score call
    message_tokens: int = 256  # an environment message longer than this is cut to it (tool output)

    def __post_init__(self) -> None:
        if self.custom is not None:
            if not (isinstance(self.custom, str) and self.custom.strip()):
                raise ConfigFieldError(
                    "custom", f"must be 'module:Class', 'python' or null, got {self.custom!r}"
                )
            from megatron_rl.environments.calls import load_environment  # lazy: calls imports this module

            load_environment(self.custom)  # a class that cannot be had fails at load, with the recipe line
        if not isinstance(self.options, dict) or not all(isinstance(k, str) for k in self.options):
            raise ConfigFieldError("options", f"must be a mapping of keyword arguments, got {self.options!r}")
        check_range("max_turns", self.max_turns, low=1, high=1024)
        check_range("max_tokens", self.max_tokens, low=1, high=1 << 20)
        check_range("step_timeout_s", self.step_timeout_s, low=0.001, high=86400.0)
        check_range("message_tokens", self.message_tokens, low=1, high=1 << 20)

    @property
    def enabled(self) -> bool:
        return self.custom is not None
