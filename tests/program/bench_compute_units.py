"""Print the compute units the SDK's building blocks cost, measured on the fixture programs in LiteSVM.

Run from the repository root: ``python tests/program/bench_compute_units.py``. It prints figures and
asserts nothing about them (a benchmark, not a test); the coordinator's budget is planned from these.
"""

from __future__ import annotations

import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from sbpf_harness import Chain, build_fixture, clang_missing, ok, readonly, writable
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.system_program import ID as SYSTEM_PROGRAM_ID


def _minimal(chain: Chain, accounts: int) -> int:
    metas = [readonly(Keypair().pubkey()) for _ in range(accounts)]
    return ok(chain.send(metas, b"")).compute_units_consumed()


def _sha256(chain: Chain, size: int) -> int:
    target = chain.program_account(32)
    return ok(chain.send([writable(target)], bytes(size))).compute_units_consumed()


def _sysvars(chain: Chain) -> int:
    target = chain.program_account(48)
    return ok(chain.send([writable(target)], struct.pack("<Q", 100))).compute_units_consumed()


def _heap(chain: Chain) -> int:
    target = chain.program_account(64)
    return ok(chain.send([writable(target)], struct.pack("<4I", 64, 64, 64, 64))).compute_units_consumed()


def _create_pda(chain: Chain) -> int:
    run_id = (7).to_bytes(8, "little")
    pda, bump = Pubkey.find_program_address([b"coordinator", run_id], chain.program_id)
    accounts = [writable(chain.payer.pubkey(), signer=True), writable(pda), readonly(SYSTEM_PROGRAM_ID)]
    units = ok(chain.send(accounts, b"\x00" + run_id + struct.pack("<Q", 1024))).compute_units_consumed()
    print(f"  (bump {bump}: {256 - bump} find_program_address tries at 1,500 CU each)")
    return units


def _transfer(chain: Chain) -> int:
    accounts = [
        writable(chain.payer.pubkey(), signer=True),
        writable(Pubkey.new_unique()),
        readonly(SYSTEM_PROGRAM_ID),
    ]
    return ok(chain.send(accounts, b"\x01" + struct.pack("<Q", 1_000_000))).compute_units_consumed()


def _multi(chain: Chain) -> int:
    return ok(chain.send([], b"the quick brown fox jumps over the lazy dog" * 10)).compute_units_consumed()


SCENARIOS: list[tuple[str, str, Callable[[Chain], int]]] = [
    ("entrypoint + deserialize, no accounts", "minimal", lambda c: _minimal(c, 0)),
    ("entrypoint + deserialize, 10 accounts", "minimal", lambda c: _minimal(c, 10)),
    ("sha256 of 32 bytes into an account", "sha256_account", lambda c: _sha256(c, 32)),
    ("sha256 of 1,000 bytes into an account", "sha256_account", lambda c: _sha256(c, 1000)),
    ("clock sysvar + rent-exempt minimum", "sysvars", _sysvars),
    ("4 heap allocations of 64 bytes, filled", "heap", _heap),
    ("CPI: create a 1 KiB PDA account", "cpi_pda", _create_pda),
    ("CPI: system transfer", "cpi_pda", _transfer),
    ("count vowels in 430 bytes (2 objects)", "multi", _multi),
]


def main() -> int:
    if clang_missing():
        print("clang-14 is not installed: apt-get install -y clang-14", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        built = {name: build_fixture(name, Path(tmp)) for name in {fixture for _, fixture, _ in SCENARIOS}}
        for label, fixture, run in SCENARIOS:
            units = run(Chain(built[fixture]))
            print(f"{label:<44} {units:>7,} CU   ({fixture}.so, {len(built[fixture]):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
