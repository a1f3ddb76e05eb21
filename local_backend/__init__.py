"""The services a run's operator hosts: the centralised TCP backend (``protocol``, ``peers``, ``server``,
``store``: it owns one coordinator, persists it, ticks it and broadcasts its state) and the run's auth service
(``auth/``).

May import: coordinator_program, client.identity.
"""
