"""Averaging within a pipeline stage over hivemind's averager: SPARTA sparse parameter averaging or PowerGossip's
mixing of parameters in pairs, and per-step gradient averaging (full, PowerSGD or DeMo).

May import: client.identity, client.helper_processes, client.sealed, client.pipeline.
"""
