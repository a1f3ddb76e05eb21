"""The coordinator as a client sees it: one backend interface, its TCP and Solana adapters, the auto-ticker.

Everything above this package talks to the coordinator through ``backend.Backend`` and never learns which
backend runs it.

May import: coordinator_program, local_backend.protocol, client.identity, client.stages.
"""
