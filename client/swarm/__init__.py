"""The whole system on one machine: the local swarm launcher, the demo, and human-readable status views.

It drives the other parts as separate processes through the CLI, so it imports only what it reads.

May import: coordinator_program, client.identity, client.stages, client.backends, client.witness,
client.pipeline, client.data, client.models.
"""
