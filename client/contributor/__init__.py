"""The contributor's client, one module a role: it follows the coordinator's phases and does what each one asks.

- ``runner``: the process's lifecycle (its DHT node, reconnecting to the coordinator, a bounded clean leave),
  joining and the join queue, and each phase of the state handed to this client's role;
- ``worker``: the worker role, one pipeline stage (``client.join.stage_replica``): served from Warmup, stepped
  when the coordinator leaves RoundTrain, averaged with SPARTA every ``sparta_every`` steps, snapshotted every
  ``snapshot_every``, saved at Cooldown; it publishes signed reports of the receipts it issues;
- ``trainer``: the trainer role, its share of each round's global batch through the epoch's workers, a signed
  presence and a signed commitment of its result;
- ``witnessing``: what an elected witness does whatever its role: the proof of a round's records, sent as soon
  as every batch is in (opportunistic) or at RoundWitness with what it has, and health checks; ``accusing`` the
  evidence workers publish and what witnesses make of it (averaging declarations included); ``seeding`` its
  share of the next round's seed (a secret committed in RoundTrain, revealed in RoundWitness);
- ``run_model`` the model the run names, as workers, trainers and ``psyswarm status`` build it; ``status`` what the
  live line shows; ``tasks`` the supervised background work; ``context`` what the roles share; ``rounds`` and
  ``errors`` the names they share.

The backend (TCP server or Solana program) is behind ``client.backends.base.Backend``, so this runs unchanged on
either. Blocking work (torch, the DHT, averaging) runs in threads so the state keeps flowing. With an auth service
(``client.join.auth``), the slot is renewed while the client runs, a joiner waits its turn in the join queue
before it syncs, and it reports when it has synced.

A client that cannot take part as asked (no funds for fees, a DHT it cannot reach, a join the coordinator refuses
for good, a dataset it does not have) ends with ``CannotContribute``, whose message names the problem and the fix;
passing trouble (the coordinator restarting, a refused join that may succeed later) is retried. Stopping is
bounded: the clean leave gets ``runner.STOP_TIMEOUT`` seconds, and threads still busy with compute or a peer are
left.

May import: coordinator_program, client.identity, client.receipts, client.stages, client.backends, client.witness,
client.pipeline, client.averaging, client.join, client.data, client.models.
"""
