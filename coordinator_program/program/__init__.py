"""The coordinator as a Solana program: C sources (src/), the SDK (include/), and their build.

build.py compiles with clang-14 and links with linker.py into psyswarm_coordinator.so (SBPFv0).

May import: coordinator_program.spec, coordinator_program.onchain.
"""
