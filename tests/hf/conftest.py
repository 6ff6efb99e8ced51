"""The one-rank Megatron parallel state fixture of the training tests, shared here."""

from tests.training.conftest import single_rank  # noqa: F401
