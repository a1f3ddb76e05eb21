"""The deploy tests run against ``psyswarm localnet`` in its own process: the Solana tests' session fixture."""

from tests.solana.conftest import localnet  # noqa: F401 - a fixture, found by pytest through this import
