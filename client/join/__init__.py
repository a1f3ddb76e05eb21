"""The contributor join flow: authorization and the join queue, state download outside averaging rounds,
the sync phases, checkpoints, and a worker's place among its stage's replicas (``stage_replica``).

May import: coordinator_program, local_backend.auth.protocol, client.identity, client.stages,
client.helper_processes, client.pipeline, client.averaging, client.models.
"""
