"""Witnessing: the signed round records clients publish in the DHT, and what an elected witness concludes.

Pure record handling: it never runs a model, so it does not import the pipeline.

May import: coordinator_program, client.identity, client.receipts, client.answers, client.stages, client.sealed.
"""
