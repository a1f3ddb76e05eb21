"""CLI command groups; each module exposes ``register(app)`` and imports heavy libraries lazily.

May import: coordinator_program, local_backend, client.
"""
