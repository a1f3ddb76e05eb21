"""The centralised TCP backend: owns one coordinator, persists it, ticks it and broadcasts its state.

May import: coordinator_program, client.identity.
"""
