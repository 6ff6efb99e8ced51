"""Value checks shared by the component configs (kept apart from ``config.py`` so that component
configs can import them without importing every other component)."""

from __future__ import annotations

__all__ = ["ConfigFieldError", "check_range", "check_choice"]


class ConfigFieldError(ValueError):
    """Raised by a config's ``__post_init__``; the loader adds the file, line and section."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_range(name: str, value: float, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """Raise :class:`ConfigFieldError` unless ``value`` lies in the given (half-)open range."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "inf" if high is None else f"{high}{')' if high_open else ']'}"
        if low is None:
            lo = "(-inf"
        if high is None:
            hi = "inf)"
        raise ConfigFieldError(name, f"must be in {lo}, {hi}, got {value!r}")


def check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ConfigFieldError(name, f"must be one of {list(choices)}, got {value!r}")
