"""The coordinator's executable specification: what the rules are, and nothing that merely carries them.

Every backend runs these functions: the TCP server calls them directly, and the C program in ``program/``
implements the same rules, checked against vectors generated from here. Pure and deterministic: the caller
passes the time and the entropy; nothing here does I/O or imports a Solana client or an HTTP library.

- ``limits``, ``errors``: the account's fixed capacities and the typed rejections of every operation;
- ``layout``: the Borsh-compatible schema language the account and the instructions are declared in;
- ``config``, ``state``: a run's configuration and the coordinator's state, with their layouts;
- ``selection``, ``bloom``, ``schedule``: what a round's seed decides, the witness filters, the learning rate;
  ``filter_sizing``: how large those filters are;
- ``derived``: what everyone reads off the state alike (the instance name, witnesses, quorum, data assignment, stages);
- ``beacon``: the commit-reveal behind every seed; ``reveals``: its operations (commitments, reveals and their close);
- ``signers``: who may act; ``rules``: the other operations and the tick; ``points``: what a round earns and the
  ledger it goes into;
- ``instructions``: each instruction's bytes and how it applies.

May import: nothing outside this package.
"""
