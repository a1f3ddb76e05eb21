"""The run's auth service: a Hugging Face token in, a contributor slot and a stage out; and the run's join
authority, which countersigns each join the coordinator admits.

The token is used for identity only (``identity``: the Hub's whoami) and never stored, only its sha256. Every
process started with the same token is the same contributor; each holds its own slot, and one contributor holds
at most a few, so no one can fill the swarm (``rules``, which also pace joiners through the join queue).

Requests are JSON over HTTP, each signed by the peer's ed25519 key (``protocol``, the one module the client
imports; ``requests`` checks them): a captured request cannot be replayed (its nonce is spent), nor sent under
another token (its hash is signed), nor for another run or action, nor long after it was signed. Grants are
signed by the service's key. Slots and spent nonces live in SQLite (``slots``), one transaction per request,
answered only after it commits, so a restart forgets no contributor and re-opens no replay. A request that can
change nothing spends no nonce, and the nonces one token or one address may hold are bounded, so a flood fills
no store and locks no one out.

The service's key is the run's join authority: the coordinator (``psyswarm serve`` or ``create-run``
``--join-authority``) admits a join only with its countersignature (``countersign``: the TCP
``join_authorization``, or the Solana join_run transaction message), so admission holds even against a client
that never asks the service. The coordinator holds each slot to one live key; a slot that ends (``ending``) is
freed only once the coordinator has withdrawn its key, which ``release`` tells it. ``app`` serves it all over
HTTP.

May import: coordinator_program, client.identity, local_backend.protocol, local_backend.store, local_backend.web.
"""
