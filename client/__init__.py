"""What a contributor runs, one subpackage per part of the system.

- ``coordinator/`` the coordinator as a client sees it; ``witness/`` signed round records and their judgement;
- ``pipeline/`` the model's stages, workers, trainers and discovery; ``averaging/`` SPARTA within a stage;
- ``join/`` authorization, state download and sync phases; ``swarm/`` the local swarm, the demo, status views;
- ``runner`` the contributor's state machine over all of these; ``commands/`` and ``cli`` the ``psyswarm`` CLI;
- ``identity``, ``stages`` and ``helper_processes``: the small foundations every part may use.

Each package and top-level module names what it may import on a ``May import:`` line; tests/test_layout.py
keeps the graph layered by failing on any import outside it.
"""
