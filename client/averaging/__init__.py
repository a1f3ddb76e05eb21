"""Averaging within a pipeline stage over hivemind's averager: SPARTA sparse parameter averaging, and per-step
gradient averaging (full or PowerSGD).

May import: client.identity, client.helper_processes, client.sealed, client.pipeline.
"""
