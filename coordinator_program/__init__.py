"""The coordinator: its executable specification, its codec and IDL, the on-chain program and a local chain.

The specification stands alone: every backend and client builds on it, never the other way round.

May import: nothing outside this package.
"""
