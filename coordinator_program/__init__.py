"""The coordinator: its executable specification, and what carries it.

- ``spec/`` the specification: the rules, the state and the codec of the account and of every instruction; pure;
- ``onchain/`` where it lives on Solana: the instance account, the program id, the IDL, deployment;
- ``program/`` the C program that implements the specification on chain, and its build;
- ``localnet/`` a development chain (LiteSVM behind Solana's JSON-RPC) where no validator is installed;
- ``facts`` what a config and a state mean for people: the CLI's figures and words.

The specification stands alone: every backend and client builds on it, never the other way round.

May import: nothing outside this package.
"""
