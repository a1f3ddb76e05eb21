"""Averaging within a pipeline stage: SPARTA sparse parameter averaging over hivemind's averager.

May import: client.helper_processes, client.pipeline.
"""
