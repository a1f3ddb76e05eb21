"""What a contributor runs, one subpackage per part of the system.

- ``backends/`` the coordinator as a client sees it; ``witness/`` signed round records and their judgement;
- ``pipeline/`` the model's stages, workers, trainers and discovery; ``averaging/`` SPARTA within a stage;
- ``models/`` the models a run may train; ``data/`` the data addressed by sample index;
- ``join/`` authorization, state download and sync phases; ``swarm/`` the local swarm, the demo, status views;
- ``contributor/`` the contributor's process, one module a role (runner, worker, trainer, witnessing);
- ``commands/`` and ``cli`` the ``psyswarm`` CLI; ``dashboard/`` its web view of a run;
- ``identity``, ``stages``, ``helper_processes``, ``sealed`` and ``receipts``: the small foundations every part may
  use.

Each package and top-level module names what it may import on a ``May import:`` line; tests/test_layout.py
keeps the graph layered by failing on any import outside it.
"""
