"""The project's default program id: where ``psyswarm localnet`` loads the coordinator program.

The address is the public half of ``program/program-keypair.json``, a keypair generated for development
and committed on purpose, so that the local chain, the clients and a development deployment agree on one
address without configuration. Its secret is public: a real deployment uses a keypair of its own and
passes the resulting address to the clients (``--program-id`` or ``PSYSWARM_PROGRAM_ID``).
"""

from __future__ import annotations

from pathlib import Path

from solders.pubkey import Pubkey

PROGRAM_KEYPAIR_PATH = Path(__file__).resolve().parents[1] / "program" / "program-keypair.json"
PROGRAM_ID = Pubkey.from_string("FhKCPmEoX7GbcCTvvQ6o4cahgjdyxQivYUFsAnNqNZ3z")
