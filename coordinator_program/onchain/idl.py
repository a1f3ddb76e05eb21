"""The coordinator's IDL in Anchor's legacy JSON format, generated from the layouts.

anchorpy 0.21 reads this format to build and decode instructions and accounts, so a client can drive the
program with nothing but the IDL. The committed ``idl/psyswarm_coordinator.json`` is this module's output;
a test fails if they differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator_program.onchain.instance import INSTANCE_LAYOUT
from coordinator_program.spec.errors import ALL_ERRORS
from coordinator_program.spec.instructions import INSTRUCTIONS
from coordinator_program.spec.layout import camel, referenced_types
from coordinator_program.spec.state import ACCOUNT_LAYOUT, ACCOUNT_NAME

PROGRAM_NAME = "psyswarm_coordinator"
IDL_PATH = Path(__file__).parent / "idl" / f"{PROGRAM_NAME}.json"


def build_idl() -> dict[str, Any]:
    """The IDL as a JSON-ready dict."""
    instructions = [{
        "name": camel(ix.NAME),
        "accounts": [{"name": a.name, "isMut": a.mut, "isSigner": a.signer} for a in ix.ACCOUNTS],
        "args": [{"name": camel(f.name), "type": f.type.idl()} for f in ix.LAYOUT.fields],
    } for ix in INSTRUCTIONS]
    account = ACCOUNT_LAYOUT.idl_definition()
    account["name"] = ACCOUNT_NAME
    types = referenced_types([ACCOUNT_LAYOUT] + [f.type for ix in INSTRUCTIONS for f in ix.LAYOUT.fields])
    return {
        "version": "0.1.0",
        "name": PROGRAM_NAME,
        "instructions": instructions,
        "accounts": [account, INSTANCE_LAYOUT.idl_definition()],
        "types": [t.idl_definition() for t in types if t is not ACCOUNT_LAYOUT],
        "errors": [{"code": e.code, "name": e.__name__, "msg": e.summary} for e in ALL_ERRORS],
    }


def idl_json() -> str:
    return json.dumps(build_idl(), indent=2) + "\n"


if __name__ == "__main__":
    IDL_PATH.write_text(idl_json())
    print(f"wrote {IDL_PATH}")
