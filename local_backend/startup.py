"""What a server starts from: a new run made from the ``state.toml``, or the run its database holds, with what the
``state.toml`` changes in it.

A new run is made as its creator would on chain (``init_coordinator``, ``update``, resume, tick), each operation
stored. A stored run keeps its join authority, which ``serve`` must name again.

The coordinator's rules may change between epochs: its times, ``rounds_per_epoch``, ``total_steps``, the
membership bounds, the witnesses and their quorum, the global batch and the bloom filters' size. No epoch holds
clients while the run waits for members, so a change applied then strands no one's work; the server applies it
then, with the checks of the spec's ``update`` rule: at once if the run is waiting for members or paused, else
when the current epoch ends.

What every client built the run's parameters from cannot change: the model (every field of ``[model]``) and
``num_stages`` (the checkpoint is cut into that many stages). A restart naming another value is refused with
the difference named, and so is any change to a finished run. The starting ``[checkpoint]`` is read only when
the run is created: the stored run's checkpoint has moved on since.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable

from solders.keypair import Keypair

from coordinator_program.facts import admission
from coordinator_program.spec import rules
from coordinator_program.spec.config import Config, RunSpec, validate_config, validate_model
from coordinator_program.spec.errors import InvalidConfig
from coordinator_program.spec.instructions import SetPaused, Tick, Update
from coordinator_program.spec.state import CoordinatorState, Phase, decode_state, encode_state
from local_backend.store import RunStore, StoreError

log = logging.getLogger("psyswarm.server")

FIXED_CONFIG_FIELDS = ("num_stages",)
"""Config fields that can never change: the checkpoint's stages and the clients' stage indices depend on them."""

APPLICABLE_PHASES = (Phase.WaitingForMembers, Phase.Paused)
"""Where no epoch holds clients, so a new config strands no one's work."""


def differences(section: str, stored: object, wanted: object) -> list[str]:
    """``section.field: stored -> wanted`` for each field of two dataclasses of one type that differs."""
    return [f"{section}.{f.name}: {getattr(stored, f.name)!r} -> {getattr(wanted, f.name)!r}"
            for f in dataclasses.fields(stored) if getattr(stored, f.name) != getattr(wanted, f.name)]


def refusal(state: CoordinatorState, spec: RunSpec) -> str | None:
    """Why ``spec`` cannot be applied to the stored run (None when it can, or when nothing differs)."""
    fixed = differences("model", state.model, spec.model) + [
        change for change in differences("config", state.config, spec.config)
        if change.split(":")[0].split(".")[1] in FIXED_CONFIG_FIELDS]
    if fixed:
        return (f"the config changes what the run's parameters were built from ({'; '.join(fixed)}): put the stored "
                "values back in the state.toml, or start another run with another --db")
    if state.phase == Phase.Finished and state.config != spec.config:
        return (f"the run finished, so its config can no longer change "
                f"({'; '.join(differences('config', state.config, spec.config))}): put the stored values back, or "
                "start another run with another --db")
    return None


def update_instruction(state: CoordinatorState, config: Config) -> bytes:
    """The ``update`` its main authority would send to give the run ``config``: what the run's log records. An
    ``update`` names one starting place for every stage, while ``apply_config`` keeps each stage's as it stands; the
    log names the first stage's."""
    return Update(config, state.model, state.checkpoints[0]).encode()


def apply_config(state: CoordinatorState, config: Config) -> None:
    """Give a run that waits for members, or is paused, the rules ``config``.

    It checks what the spec's ``update`` rule checks of a config (its own rules, the model's fit, the queue's
    fit), but not the starting checkpoint: that rule sets one place for every stage, while the run holds the place
    each stage's workers last reported (or P2P, where none did), which stays as it is.
    Raises the coordinator's error and leaves ``state`` unchanged when the run cannot take ``config``.
    """
    assert state.phase in APPLICABLE_PHASES, state.phase
    validate_config(config)
    validate_model(state.model, config)
    if len(state.pending) > config.max_clients:
        raise InvalidConfig(f"max_clients: {len(state.pending)} joiners are already queued")
    state.config = config
    state.nonce += 1


def open_run(spec: RunSpec, store: RunStore, authority: Keypair, join_authority: bytes,
             clock: Callable[[], int]) -> tuple[CoordinatorState, Config | None]:
    """The run to serve, stored, and the rules it takes once it next waits for members (None if none are due).

    Raises ``StoreError`` (nothing changed) for a stored run of another join authority, or one the
    ``state.toml`` changes in what cannot change, and the coordinator's error for rules the run cannot take.
    """
    me = bytes(authority.pubkey())

    def persist(state: CoordinatorState, instruction: bytes, change: Callable[[], None]) -> None:
        change()
        store.save(state.run_id, state.nonce, encode_state(state), me, instruction)

    stored = store.load(spec.run_id)
    if stored is None:
        state = rules.init_coordinator(spec.run_id, me, join_authority, clock())
        persist(state, Update(spec.config, spec.model, spec.checkpoint).encode(),
                lambda: rules.update(state, me, spec.config, spec.model, spec.checkpoint))
        persist(state, SetPaused(False).encode(), lambda: rules.set_paused(state, me, False))
        persist(state, Tick().encode(), lambda: rules.tick(state, clock(), secrets.randbits(64)))
        log.info("created run %r in %s, %s", state.run_id, store.path, admission(state.join_authority))
        return state, None
    state = decode_state(stored)
    if state.join_authority != join_authority:
        held, asked = admission(state.join_authority), admission(join_authority)
        raise StoreError(f"{store.path} holds run {state.run_id!r}, {held}, not {asked}: a run's join authority is "
                         "fixed when it is created; give the run's own, or another --db")
    why_not = refusal(state, spec)
    if why_not is not None:
        raise StoreError(f"{store.path} holds run {state.run_id!r}, and {why_not}")
    log.info("resumed run %r from %s: %s, epoch %d, step %d, %s", state.run_id, store.path, state.phase.name,
             state.epoch, state.step, admission(state.join_authority))
    changes = differences("config", state.config, spec.config)
    if not changes:
        return state, None
    if state.phase not in APPLICABLE_PHASES:
        log.info("the state.toml changes the run's rules, applied when epoch %d ends and the run waits for members: "
                 "%s", state.epoch, "; ".join(changes))
        return state, spec.config
    persist(state, update_instruction(state, spec.config), lambda: apply_config(state, spec.config))
    log.info("the state.toml changes the run's rules, applied now (%s): %s", state.phase.name, "; ".join(changes))
    return state, None
