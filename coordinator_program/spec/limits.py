"""Fixed capacities of the coordinator account.

They size the account's fixed layout, which the Python specification, the C program and anchorpy's IDL
coder all share, so changing one of them is a change of the on-chain format.
"""

MAX_CLIENTS = 1024
"""Clients admitted to one epoch, and also the most pending joiners the account can hold."""

PART_CLIENTS = 128
"""Clients one part of a witness proof covers: part p holds the filters of client indices [128p, 128p + 128).
A proof of n clients is ceil(n / 128) parts, each its own transaction, so a proof grows in transactions rather than
outgrowing one, and each part's tally costs the same whatever the run's size."""

MAX_PARTS = MAX_CLIENTS // PART_CLIENTS
"""Parts of a proof at full size; a witness's received parts are tracked in a 32-bit mask."""
assert MAX_PARTS <= 32 and MAX_CLIENTS % PART_CLIENTS == 0

CREDIT_CLIENTS = 128
"""Clients one tick credits at the end of a round: a round of more takes several ticks (``points.credit_chunk``)."""

CREDIT_EVICTIONS = 4
"""New ledger entries one crediting tick places in a full ledger before it stops: each scans the whole ledger for
the entry with the fewest points, so this bounds the tick's cost."""

MAX_WITNESSES = 32
"""Witnesses elected per round; a round's submissions are tracked in a 32-bit mask."""

UNELECTED = 0xFFFF
"""Every seat of ``Round.witnesses`` while an epoch's warmup waits for its joiners to reveal the secrets they committed
to when they joined (``derived.revealing``): no one is elected by a seed a joiner could have foreseen."""

MAX_STAGES = 16
"""Pipeline stages; the coordinator keeps a checkpoint place for each (``CoordinatorState.checkpoints``)."""

RUN_ID_BYTES = 32
"""A run id is a PDA seed on chain, and seeds are at most 32 bytes."""

MAX_BLOOM_BYTES = 480
"""Room for one filter of a proof part. Two filters of this size plus a transaction's fixed parts fit the
1,232-byte Solana transaction limit, which is what bounds it."""

REPO_BYTES = 96
"""A Hugging Face repo id (``org/name``) or a local checkpoint directory."""

REVISION_BYTES = 64
"""A git revision (commit sha or branch) of a checkpoint."""

DATASET_BYTES = 96
"""Where the training data comes from (``stdlib``, a local path, or ``hf:org/name``)."""

ARCHITECTURE_BYTES = 24
"""A model's architecture: ``psyswarm`` or a transformers ``model_type`` (``llama``, ``qwen2``, ...)."""

SOURCE_BYTES = 96
"""Where an HF model's config.json and tokenizer come from: a Hub repo id or a local directory."""

SOURCE_REVISION_BYTES = 40
"""A Hub revision of the model's source (a commit sha is 40 hex characters)."""

MAX_POWERSGD_RANK = 64
"""The largest rank of PowerSGD's low-rank gradient factors."""

MAX_DEMO_CHUNK = 128
"""The most elements DeMo transforms as one chunk: a position within it is one byte on the wire
(``client.averaging.demo.MAX_CHUNK``, which must agree)."""

MAX_DEMO_BETA_PERMILLE = 999
"""DeMo's largest momentum decay, in thousandths: below 1, or the momentum would never decay."""

MAX_AUDIT_PERMILLE = 1000
"""The largest audit rate, in thousandths: every other reducer of every round audited."""

NO_STAGE = 0xFF
"""The stage of a trainer, and of a worker that lets the coordinator choose its stage."""

NO_SLOT = 0xFFFF
"""The slot of a joiner no join authority placed: any joiner of a permissionless run. A permissioned run's join
authority names the slot its countersignature grants, and the coordinator keeps at most one live key per slot."""

NO_DEADLINE = 2**63 - 1
"""The ``valid_until`` of a join that never expires (the largest i64): a permissionless joiner's."""

SOLANA_TX_LIMIT = 1232
"""The most bytes one Solana transaction may take on the wire."""
