"""Pipeline training: the model cut into stages, the workers that serve them, the trainers that route
microbatches through them, and discovery over hivemind's DHT. See ``trainer.py`` for the flow of a step.

It knows nothing of the coordinator or of witnessing: the contributor's roles (``client.contributor``) tie a round
to the pipeline's work.

May import: client.identity, client.receipts, client.answers, client.stages, client.helper_processes, client.sealed,
client.data, client.models.
"""
