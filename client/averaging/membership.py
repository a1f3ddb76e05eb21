"""Who may average in a stage: the coordinator's roster, and declarations sealed by each member's key.

hivemind's averaging admits any peer that finds the group key in the DHT, and anyone who knows the run id can
compute it. So every peer that averages a stage's parameters or gradients declares, in hivemind's all-gather,
what it brings to the round (round, weight, norm…) together with its ed25519 public key and a signature over:
the averager's prefix (run, stage and kind of round), the epoch, its libp2p peer id and the declaration. A
groupmate is admitted to a round only if

- its key is on the roster: the workers the coordinator lists for the stage in the current epoch, healthy;
- the signature holds for the peer id it joined under (libp2p authenticates peer ids, so a stranger cannot
  reuse a member's declaration: it would have to send its parts as the member);
- it declares this round and epoch, and no other groupmate declares the same key (one seat per member);
- its weight is a number from 0 to the most its role can honestly claim in such a round (``max_weight``: a
  round's global batch for a gradient round, the samples a worker can have processed in it; 1 for a SPARTA
  round, where replicas weigh alike). A mean follows a large weight without bound, and in a group
  of two the robust reduction's cap binds nobody (``client.averaging.robust``), so a claim above it is refused
  like a malformed one rather than clipped: a peer that claims what it cannot have done is not trusted with a
  smaller weight either;
- where the round credits work (``work``: a coordinated run's gradient rounds), its evidence — the trainer-signed
  headers of the Backwards it accumulated, each naming its key as the worker it was sent to — verifies, and its
  weight becomes at most the samples they prove (``client.averaging.work``; the roster names the epoch's
  trainers, whose signatures count).

Every groupmate sees the same gathered declarations (the leader hands the same list to all), so the honest ones
admit the same peers and run the all-reduce among them alone; a leader also refuses a follower whose
declaration does not pass before the group forms.

Some refusals prove a lie (``falsehood``): the seal holds, so the member signed the declaration, and what it
signed is something no honest worker declares, whatever the timing or its view of the roster: a weight that is not
a number from 0 to ``max_weight``, or evidence of work that is malformed or holds a header not signed for the
member itself (forged, or copied from a groupmate). Such a declaration is evidence anyone can check with the run's
settings alone; the groupmates that gathered it hand it on, and the witnesses leave its signer out of the round
(``client.contributor.accusing``). Other refusals (not on the roster, another epoch or round, a second seat, a
seal that does not hold) prove nothing against the key: they happen to honest peers between rounds or epochs,
and an unsealed declaration is nobody's word. Nor does evidence listing more Backwards than the round has samples:
it is refused before any signature is read, and checking it for a lie would cost what its length is bounded to
spare.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solders.keypair import Keypair

from client.averaging.work import WorkRule, credited, proven_samples
from client.identity import to_json, verify

_DOMAIN = "psyswarm.averaging"
STATE_SHARING = -1
"""The round a donor's declaration names: it serves its state between averaging rounds, and a joiner admits a
donor under the same rules as a groupmate (roster, epoch, seal over its peer id)."""


@dataclass(frozen=True)
class Roster:
    """The ed25519 public keys allowed to average a stage in ``epoch`` (the coordinator's list), and those of the
    epoch's trainers, whose signed Backwards are the only evidence of work a round credits."""

    epoch: int
    members: frozenset[bytes]
    trainers: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class Membership:
    """A peer's own seat: the key it signs declarations with, and where it reads the current roster."""

    keypair: Keypair
    roster: Callable[[], Roster]

    @property
    def key(self) -> bytes:
        return bytes(self.keypair.pubkey())


def _message(prefix: str, epoch: int, peer_id: bytes, body: dict[str, Any]) -> bytes:
    """What a seal covers; ``ValueError`` or ``TypeError`` where ``body`` (a groupmate's) is not plain data."""
    return to_json([_DOMAIN, prefix, int(epoch), peer_id.hex(), body], sort_keys=True, separators=(",", ":"),
                   allow_nan=False)


def seal(membership: Membership, prefix: str, peer_id: bytes, epoch: int, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (what the peer declares: round, weight…) with its key, epoch and signature added."""
    signature = membership.keypair.sign_message(_message(prefix, epoch, peer_id, body))
    return {**body, "epoch": int(epoch), "member": membership.key.hex(), "seal": bytes(signature).hex()}


@dataclass(frozen=True)
class Declared:
    """A groupmate's admitted declaration: its key, what it declared (round, weight and the rest) and, where the
    round credits work, the samples its evidence proves (None: its declared weight stands)."""

    member: bytes
    body: dict[str, Any]
    samples: frozenset[int] | None = None

    @property
    def weight(self) -> float:
        """The weight it averages with: its declared one, at most the samples its evidence proves."""
        return credited(float(self.body["weight"]), self.samples)


def check(declaration: object, prefix: str, peer_id: bytes, roster: Roster, round_: int,
          max_weight: float = math.inf, work: WorkRule | None = None) -> Declared | str:
    """The declaration if ``peer_id`` may take part in round ``round_`` with it, claiming at most ``max_weight``
    and, under ``work``, proving its samples with evidence (its ``work`` field), else why not."""
    opened = _opened(declaration)
    if isinstance(opened, str):
        return opened
    key, sig, epoch, body = opened
    if key not in roster.members:
        return "its key is not on the stage's roster"
    if epoch != roster.epoch or body.get("round") != round_:
        return f"it declares epoch {epoch} round {body.get('round')!r}, not epoch {roster.epoch} round {round_}"
    refusal = _weight_refusal(body.get("weight"), max_weight)
    if refusal:
        return refusal
    try:
        message = _message(prefix, epoch, peer_id, body)
    except (TypeError, ValueError):
        return "its declaration is not plain data"
    if not verify(key, message, sig):
        return "its seal does not hold for its peer id"
    if work is None:
        return Declared(key, body)
    proven = proven_samples(body.get("work"), work, round_, roster.trainers, key)  # signatures after the seal's
    return proven if isinstance(proven, str) else Declared(key, body, proven)


def _opened(declaration: object) -> tuple[bytes, bytes, int, dict[str, Any]] | str:
    """A declaration's key, seal, epoch and body (what the seal covers besides them), unverified; or why it has
    none."""
    if not isinstance(declaration, dict):
        return "its declaration is not a dict"
    body = {k: v for k, v in declaration.items() if k not in ("epoch", "member", "seal")}
    member, signature, epoch = declaration.get("member"), declaration.get("seal"), declaration.get("epoch")
    if not (isinstance(member, str) and isinstance(signature, str) and isinstance(epoch, int)):
        return "its declaration is not sealed"
    try:
        return bytes.fromhex(member), bytes.fromhex(signature), epoch, body
    except ValueError:
        return "its key or seal is not hex"


def _weight_refusal(weight: object, max_weight: float) -> str:
    """Why ``weight`` is not one a worker can declare, or ""."""
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 <= weight < math.inf:
        return f"it declares weight {weight!r}"
    if weight > max_weight:
        return f"it declares weight {weight!r}, above the {max_weight:g} a worker can claim in a round"
    return ""


def falsehood(declaration: object, prefix: str, peer_id: bytes, max_weight: float,
              work: WorkRule | None) -> tuple[bytes, str] | None:
    """The member that sealed ``declaration`` and the lie it proves (module docstring), or None where it proves
    none: it is not sealed by the key it names for ``peer_id`` under ``prefix``, or it is what an honest worker
    could have declared."""
    opened = _opened(declaration)
    if isinstance(opened, str):
        return None
    key, sig, epoch, body = opened
    try:
        message = _message(prefix, epoch, peer_id, body)
    except (TypeError, ValueError):
        return None
    if not verify(key, message, sig):
        return None
    refusal = _weight_refusal(body.get("weight"), max_weight)
    if refusal:
        return key, f"it sealed what a worker cannot: {refusal}"
    listed = body.get("work")
    if work is None or isinstance(listed, list | tuple) and len(listed) > work.round_samples:
        return None  # a flood is refused unread (it costs no one its signatures); a step spanning a round's end
    proven = proven_samples(listed, work, 0, frozenset(), key)  # might list that many honestly
    return (key, f"it sealed evidence that is not its own: {proven}") if isinstance(proven, str) else None
