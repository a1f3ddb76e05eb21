"""What the dashboard shows, as JSON built by pure functions of the coordinator state and the DHT's records.

Everything here is a plain value (str, int, float, list, dict): the page renders it as text, so a name or a
repository string a peer chose can never become markup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from solders.pubkey import Pubkey

from client.dashboard.history import MAX_LOSS_POINTS, RoundResult
from client.stages import stage_names
from client.swarm.status import ROUND_PHASES, checkpoint_text, last_epoch, phase_limit, syncing_counts
from coordinator_program.spec import derived, limits
from coordinator_program.spec.state import CoordinatorState, Phase, Role


def key_text(identity: bytes) -> str:
    """A client's key as its owner sees it in the Solana CLI: base58."""
    return str(Pubkey.from_bytes(identity))


def progress(state: CoordinatorState, now: float) -> dict[str, Any]:
    """Phase, epoch, round and step, with the seconds spent in the phase and left before it times out (by the
    config's duration for the phase; None for a phase that waits for something other than time)."""
    elapsed = max(0, int(now) - state.phase_start)
    limit = phase_limit(state)
    return {
        "run_id": state.run_id,
        "phase": state.phase.name,
        "pause_requested": state.pause_requested and state.phase != Phase.Paused,
        "epoch": last_epoch(state),
        "round": state.round.height + 1 if state.phase in ROUND_PHASES else None,
        "rounds_per_epoch": state.config.rounds_per_epoch,
        "step": state.step,
        "total_steps": state.config.total_steps,
        "phase_elapsed": elapsed,
        "phase_left": None if limit is None else max(0, limit - elapsed),
    }


def occupancy(state: CoordinatorState, announced: Mapping[str, Sequence[Any]] | None) -> dict[str, Any]:
    """Per stage: the coordinator's members and, from the DHT's worker records (``announced``: stage name →
    records with a ``sync_phase``; None without a DHT), how many are active and how many are in each sync phase."""
    members = derived.stage_workers(state.clients, state.config.num_stages)
    stages = []
    for name, count in zip(stage_names(state.config.num_stages), members, strict=True):
        row: dict[str, Any] = {"name": name, "members": count, "active": None, "sync1": None, "sync2": None}
        if announced is not None:
            found = announced.get(name, [])
            sync1, sync2 = syncing_counts(list(found))
            row.update(active=len(found) - sync1 - sync2, sync1=sync1, sync2=sync2)
        stages.append(row)
    return {"stages": stages, "trainers": sum(1 for c in state.clients if c.role == Role.Trainer),
            "pending": len(state.pending), "min_clients": state.config.min_clients,
            "max_clients": state.config.max_clients}


def witnesses(state: CoordinatorState) -> dict[str, Any]:
    """This round's elected witnesses, which of them sent a proof, and the quorum that ends the round."""
    if not state.clients or state.phase not in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
        return {"elected": [], "received": 0, "quorum": None}
    elected = [{"key": key_text(w), "proved": bool(state.round.witnessed >> i & 1)}
               for i, w in enumerate(derived.witnesses(state))]
    return {"elected": elected, "received": state.round.witness_count, "quorum": derived.quorum(state)}


def checkpoint(state: CoordinatorState) -> dict[str, Any]:
    """Where joiners get each stage, spelled as ``psyswarm status`` spells it (stages by name, grouped by place)."""
    names = stage_names(state.config.num_stages)
    stages = [{"stage": name, "kind": cp.kind.name, "repo": cp.repo, "revision": cp.revision}
              for name, cp in zip(names, state.checkpoints, strict=False)]
    return {"stages": stages, "text": checkpoint_text(state)}


def leaderboard(ledger: Sequence[Any], contributors: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per contributor, its keys' points summed, when ``contributors`` (base58 key → name, from the
    run's auth service) names the key's owner; one row per key otherwise. Highest total first.

    A key the map does not name stays a row of its own, even if some contributor's name equals it: a name
    never absorbs a key's points by looking like the key."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in ledger:
        key = key_text(entry.id)
        name = contributors.get(key)
        group = ("contributor", name) if name is not None else ("key", key)
        row = rows.setdefault(group, {"name": group[1], "contributor": name is not None, "keys": 0,
                                      "presence": 0, "compute": 0})
        row["keys"] += 1
        row["presence"] += entry.presence
        row["compute"] += entry.compute
    for row in rows.values():
        row["total"] = row["presence"] + row["compute"]
    return sorted(rows.values(), key=lambda r: (-r["total"], r["name"]))


class Timeline:
    """Each round's result as the run's DHT shows it, bounded to the newest ``MAX_LOSS_POINTS`` rounds."""

    def __init__(self) -> None:
        self.results: dict[tuple[int, int], RoundResult] = {}

    def record(self, result: RoundResult) -> None:
        self.results[(result.epoch, result.round)] = result
        for key in sorted(self.results)[:-MAX_LOSS_POINTS]:
            del self.results[key]

    def losses(self) -> list[dict[str, Any]]:
        return [{"epoch": r.epoch, "round": r.round + 1, "loss": r.loss} for _, r in sorted(self.results.items())]

    def tokens_per_second(self) -> float | None:
        """The newest round's throughput, by the seconds its trainers measured (None if none said)."""
        for key in sorted(self.results, reverse=True):
            rate = self.results[key].tokens_per_second
            if rate is not None:
                return rate
        return None


def snapshot(state: CoordinatorState, now: float, *, announced: Mapping[str, Sequence[Any]] | None = None,
             timeline: Timeline | None = None, contributors: Mapping[str, str] | None = None,
             dht: bool = False) -> dict[str, Any]:
    """The page's whole view of the run at ``now``."""
    timeline = timeline or Timeline()
    return {
        "progress": progress(state, now),
        "occupancy": occupancy(state, announced),
        "witnesses": witnesses(state),
        "checkpoint": checkpoint(state),
        "loss": timeline.losses(),
        "tokens_per_s": timeline.tokens_per_second(),
        "dht": dht,
        "leaderboard": leaderboard(state.ledger, contributors or {}),
        "identities": contributors is not None,
        "error": None,
    }


MAX_NAME = 96
"""The longest contributor name shown (Hub user names are far shorter)."""


def contributor_map(answer: Any) -> dict[str, str]:
    """The auth service's ``/api/contributors`` answer, checked entry by entry: base58 public keys to names of
    1..``MAX_NAME`` characters, at most ``limits.MAX_CLIENTS`` * 4 of them. ``ValueError`` names the first fault."""
    if not isinstance(answer, dict):
        raise ValueError("the auth service's contributor map is not a JSON object")
    if len(answer) > 4 * limits.MAX_CLIENTS:
        raise ValueError(f"the auth service maps {len(answer)} keys, more than a run can hold")
    for key, name in answer.items():
        try:
            Pubkey.from_string(key)
        except ValueError:
            raise ValueError(f"the auth service maps {key[:60]!r}, which is not a base58 public key") from None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"the auth service names key {key} with something other than 1..{MAX_NAME} characters")
    return dict(answer)
