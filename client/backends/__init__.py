"""The coordinator's backends as a client sees them: one interface (``base.Backend``), its adapters for the TCP
server (``tcp``) and the Solana program (``solana``), and the auto-ticker.

A *backend* is whatever runs the coordinator: the TCP server (``local_backend``) or the program on a Solana
cluster. Everything above this package talks to the coordinator through ``base.Backend`` and never learns which
backend runs it.

May import: coordinator_program, local_backend.protocol, client.identity, client.stages.
"""
