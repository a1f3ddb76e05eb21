"""``psyswarm localnet``: a development chain where no Solana validator is installed.

LiteSVM runs the coordinator program (``chain``); ``methods`` and ``pubsub`` answer the JSON-RPC and
websocket requests Solana's clients make (``jsonrpc`` frames them); ``server`` serves both. Client code is
the same against this chain and against a real cluster: only the URL differs.

May import: coordinator_program.spec, coordinator_program.onchain, coordinator_program.program.
"""
