"""The coordinator: its executable specification, its codec and IDL, the on-chain program and a local chain."""
