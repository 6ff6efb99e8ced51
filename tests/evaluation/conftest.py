"""The evaluation tests use the curation tests' fixtures (verifier pool, tiny models)."""

from tests.data.conftest import answering_folder, one_thread, pool, random_folder  # noqa: F401
