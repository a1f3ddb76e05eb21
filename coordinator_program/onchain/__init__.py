"""How the specification lives on Solana: the run's instance account, the program's address, its Anchor IDL,
and deploying the program.

The rules are the specification's (``coordinator_program.spec``); this package only names where they live on a
cluster and how a client finds and describes them.

May import: coordinator_program.spec.
"""
