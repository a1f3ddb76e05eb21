"""A run's configuration: the coordinator's rules, the model every client builds, and where it starts from.

The encoded fields are integers and fixed strings only, because the C program validates exactly the same
rules without floating point; friendlier inputs (a learning rate, a bloom error rate) are converted here
when a ``state.toml`` is read.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator_program.spec import limits
from coordinator_program.spec.choices import GradAveraging, GradValues, Schedule, Tokenizer, WireCodec
from coordinator_program.spec.errors import InvalidCheckpoint, InvalidConfig
from coordinator_program.spec.filter_sizing import bloom_params, filter_bytes, filter_capacity, largest_max_clients
from coordinator_program.spec.layout import (
    BOOL,
    U8,
    U16,
    U32,
    U64,
    Enum8,
    Field,
    FixedBytes,
    FixedStr,
    Struct,
)
from coordinator_program.spec.selection import strict_majority

BLOOM_MIN_SLICES = 11
"""pybloom-live hashes with SHA-256 (which the program gets from ``sol_sha256``) for 11 to 16 slices of
fewer than 32,768 bits; other sizes switch to hashes the program cannot compute."""
BLOOM_MAX_SLICES = 16
BLOOM_MAX_BITS_PER_SLICE = 2**15 - 1
DEFAULT_BLOOM_ERROR_RATE = 0.0009


@dataclasses.dataclass(frozen=True)
class Config:
    """The coordinator's rules for one run (times in seconds of the backend's clock)."""

    min_clients: int = 4
    max_clients: int = 64
    witness_nodes: int = 3
    witness_quorum: int = 2
    num_stages: int = 3
    bloom_slices: int = 11
    bloom_bits_per_slice: int = 85
    warmup_time: int = 10
    max_round_train_time: int = 60
    round_witness_time: int = 2
    cooldown_time: int = 10
    rounds_per_epoch: int = 10
    total_steps: int = 100
    global_batch_size: int = 32

    @property
    def bloom_bytes(self) -> int:
        """Bytes of one filter of a proof part: pybloom-live's bit array, rounded up to whole bytes."""
        return filter_bytes(self.bloom_slices, self.bloom_bits_per_slice)


CONFIG_LAYOUT = Struct(Config, [
    Field("min_clients", U16),
    Field("max_clients", U16),
    Field("witness_nodes", U8),
    Field("witness_quorum", U8),
    Field("num_stages", U8),
    Field("bloom_slices", U8),
    Field("bloom_bits_per_slice", U16),
    Field("warmup_time", U32),
    Field("max_round_train_time", U32),
    Field("round_witness_time", U32),
    Field("cooldown_time", U32),
    Field("rounds_per_epoch", U32),
    Field("total_steps", U32),
    Field("global_batch_size", U32),
], doc="The coordinator's rules for one run; times in seconds.")


PSYSWARM_ARCHITECTURE = "psyswarm"
"""The embedded byte-level model, which needs no source, digest or tokenizer file."""
NO_DIGEST = bytes(32)


@dataclasses.dataclass(frozen=True)
class Model:
    """What every client needs to build, train and average the same model."""

    n_layers: int = 6
    n_heads: int = 4
    d_model: int = 128
    seq_len: int = 128
    microbatch_size: int = 8
    learning_rate_micros: int = 1000
    init_seed: int = 0
    sparta_every: int = 20
    sparta_partitions: int = 20
    max_allowed_stale: int = 5
    sync_phase1_steps: int = 400
    sync_phase2_steps: int = 100
    dataset: str = "stdlib"
    dataset_sha256: bytes = NO_DIGEST  # of the dataset's dataset.json; all zero: none (stdlib, text read as bytes)
    architecture: str = PSYSWARM_ARCHITECTURE
    source: str = ""
    source_revision: str = ""
    config_sha256: bytes = NO_DIGEST
    tokenizer: Tokenizer = Tokenizer.Bytes
    tokenizer_sha256: bytes = NO_DIGEST
    lr_schedule: Schedule = Schedule.Constant
    warmup_steps: int = 0
    lr_floor_micros: int = 0
    grad_averaging: GradAveraging = GradAveraging.Off
    powersgd_rank: int = 0
    demo_chunk: int = 0
    demo_topk: int = 0
    demo_beta_permille: int = 0  # DeMo's momentum decay β, in thousandths
    grad_values: GradValues = GradValues.Float32
    wire_codec: WireCodec = WireCodec.Float32
    whole_batch_moment: bool = False  # each replica's Adam on the whole batch's estimated second moment
    audit_permille: int = 250  # how often, in thousandths, a peer audits each other reducer of its averaging rounds
    gossip_rank: int = 0  # 0: SPARTA's slices; 1..64: PowerGossip at that rank mixes the parameters in pairs


MODEL_LAYOUT = Struct(Model, [
    Field("n_layers", U8),
    Field("n_heads", U8),
    Field("d_model", U16),
    Field("seq_len", U16),
    Field("microbatch_size", U16),
    Field("learning_rate_micros", U32),
    Field("init_seed", U64),
    Field("sparta_every", U16),
    Field("sparta_partitions", U16),
    Field("max_allowed_stale", U16),
    Field("sync_phase1_steps", U16),
    Field("sync_phase2_steps", U16),
    Field("dataset", FixedStr(limits.DATASET_BYTES)),
    Field("dataset_sha256", FixedBytes(32)),
    Field("architecture", FixedStr(limits.ARCHITECTURE_BYTES)),
    Field("source", FixedStr(limits.SOURCE_BYTES)),
    Field("source_revision", FixedStr(limits.SOURCE_REVISION_BYTES)),
    Field("config_sha256", FixedBytes(32)),
    Field("tokenizer", Enum8(Tokenizer)),
    Field("tokenizer_sha256", FixedBytes(32)),
    Field("lr_schedule", Enum8(Schedule)),
    Field("warmup_steps", U32),
    Field("lr_floor_micros", U32),
    Field("grad_averaging", Enum8(GradAveraging)),
    Field("powersgd_rank", U8),
    Field("demo_chunk", U8),
    Field("demo_topk", U8),
    Field("demo_beta_permille", U16),
    Field("grad_values", Enum8(GradValues)),
    Field("wire_codec", Enum8(WireCodec)),
    Field("whole_batch_moment", BOOL),
    Field("audit_permille", U16),
    Field("gossip_rank", U8),
], doc="The model and training hyperparameters every client shares.")


class CheckpointKind(enum.IntEnum):
    """Where a joining client gets the model's parameters."""

    Fresh = 0  # initialise from Model.init_seed
    Hub = 1  # a Hugging Face repo at a revision
    P2P = 2  # from same-stage peers (set when an epoch ends)
    Local = 3  # a directory every client can read (development runs)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A place parameters come from: fresh, from peers, or ``repo`` (a Hub repo id or a directory) at ``revision``.

    A run starts from one place for every stage (``update``); the coordinator then keeps one per stage
    (``CoordinatorState.checkpoints``), which only that stage's workers can set, so no worker can move another
    stage's."""

    kind: CheckpointKind = CheckpointKind.Fresh
    repo: str = ""
    revision: str = ""

    @property
    def saved(self) -> bool:
        """Whether the parameters are saved here (a Hub or Local place) rather than fresh or held by peers."""
        return self.kind in (CheckpointKind.Hub, CheckpointKind.Local)


CHECKPOINT_LAYOUT = Struct(Checkpoint, [
    Field("kind", Enum8(CheckpointKind)),
    Field("repo", FixedStr(limits.REPO_BYTES)),
    Field("revision", FixedStr(limits.REVISION_BYTES)),
], doc="Where joiners download parameters: fresh, from peers, or a Hub repo or a directory at a revision.")


def _need(ok: bool, field: str, rule: str) -> None:
    if not ok:
        raise InvalidConfig(f"{field}: {rule}")


def validate_config(c: Config) -> None:
    """Reject a config that could not run, naming the first field at fault and the rule it breaks."""
    _need(2 <= c.num_stages <= limits.MAX_STAGES, "num_stages", f"must be between 2 and {limits.MAX_STAGES}")
    _need(1 <= c.max_clients <= limits.MAX_CLIENTS, "max_clients", f"must be between 1 and {limits.MAX_CLIENTS}")
    _need(c.min_clients >= c.num_stages + 1, "min_clients",
          "must be at least num_stages + 1 (a worker for every stage and one trainer)")
    _need(c.min_clients <= c.max_clients, "min_clients", "must not exceed max_clients")
    _need(1 <= c.witness_nodes <= limits.MAX_WITNESSES, "witness_nodes",
          f"must be between 1 and {limits.MAX_WITNESSES}")
    _need(c.witness_nodes <= c.min_clients, "witness_nodes",
          "must not exceed min_clients (so that every round elects all of them)")
    _need(strict_majority(c.witness_nodes) <= c.witness_quorum <= c.witness_nodes, "witness_quorum",
          f"must be a strict majority of the {c.witness_nodes} witness_nodes, at least "
          f"{strict_majority(c.witness_nodes)} and at most {c.witness_nodes} (no minority of witnesses may settle "
          "a round)")
    for name in ("warmup_time", "max_round_train_time", "round_witness_time", "cooldown_time",
                 "rounds_per_epoch", "total_steps", "global_batch_size"):
        _need(getattr(c, name) >= 1, name, "must be at least 1")
    _need(BLOOM_MIN_SLICES <= c.bloom_slices <= BLOOM_MAX_SLICES, "bloom_slices",
          f"must be between {BLOOM_MIN_SLICES} and {BLOOM_MAX_SLICES} (the SHA-256 range of pybloom-live)")
    _need(1 <= c.bloom_bits_per_slice <= BLOOM_MAX_BITS_PER_SLICE, "bloom_bits_per_slice",
          f"must be between 1 and {BLOOM_MAX_BITS_PER_SLICE}")
    _need(c.bloom_bytes <= limits.MAX_BLOOM_BYTES, "bloom_bits_per_slice",
          f"a filter of {c.bloom_bytes} bytes exceeds {limits.MAX_BLOOM_BYTES}: raise bloom_error_rate")


def _printable(text: str) -> bool:
    return all(0x20 <= ord(ch) <= 0x7E for ch in text)


def validate_model(m: Model, c: Config) -> None:
    """Reject a model the clients could not build, split into ``c.num_stages`` stages, or train identically."""
    _need(m.n_layers >= c.num_stages, "n_layers", "must be at least num_stages (a layer per stage)")
    _need(m.n_heads >= 1, "n_heads", "must be at least 1")
    _need(m.d_model >= 1 and m.d_model % m.n_heads == 0, "d_model", "must be a positive multiple of n_heads")
    _need(m.seq_len >= 2, "seq_len", "must be at least 2")
    for name in ("microbatch_size", "learning_rate_micros", "sparta_every", "sparta_partitions"):
        _need(getattr(m, name) >= 1, name, "must be at least 1")
    _need(m.dataset != "" and _printable(m.dataset), "dataset", "must be non-empty printable ASCII")
    validate_dataset_pin(m)
    validate_model_source(m)
    validate_schedule(m, c.total_steps)
    validate_grad_averaging(m)
    _need(m.audit_permille <= limits.MAX_AUDIT_PERMILLE, "audit_permille",
          f"must be at most {limits.MAX_AUDIT_PERMILLE} (audit_rate at most 1)")


STDLIB_DATASET = "stdlib"
"""The embedded corpus: part of every client, so nothing to pin."""
REMOTE_DATASET_PREFIXES = ("http://", "https://", "hf:")
"""How a dataset that clients download begins: its host could change it, so the run must pin it."""


def validate_dataset_pin(m: Model) -> None:
    """A downloaded dataset is pinned by its ``dataset.json``'s sha256, which names every token file's size and
    digest, so no host can change or inflate what the run trains on; the embedded corpus has nothing to pin. A
    local path may be either (token files pinned the same way, or text read as bytes, all zero)."""
    if m.dataset == STDLIB_DATASET:
        _need(m.dataset_sha256 == NO_DIGEST, "dataset_sha256", "must be all zero for the stdlib dataset")
    elif m.dataset.startswith(REMOTE_DATASET_PREFIXES):
        _need(m.dataset_sha256 != NO_DIGEST, "dataset_sha256",
              "must be the sha256 of the remote dataset's dataset.json, not zero")


def _architecture_name(text: str) -> bool:
    return text != "" and all(ch in "abcdefghijklmnopqrstuvwxyz0123456789_" for ch in text)


def _hub_repo_id(text: str) -> bool:
    """``org/name``: two non-empty parts of ``[A-Za-z0-9._-]``."""
    parts = text.split("/")
    return len(parts) == 2 and all(
        part != "" and all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in part) for part in parts)


LOCAL_SOURCE_PREFIXES = ("/", "./", "../", "~")
"""How a model source that is a local directory begins (anything else must be a Hub repo id)."""


def valid_source(text: str) -> bool:
    """A Hub repo id ``org/name``, or a printable ASCII local directory starting with /, ./, ../ or ~."""
    if text.startswith(LOCAL_SOURCE_PREFIXES):
        return _printable(text)
    return _hub_repo_id(text)


def validate_model_source(m: Model) -> None:
    """psyswarm's embedded model needs nothing from outside; any other architecture names its source and pins its
    config.json by digest, so that every client builds the same model or refuses to start. A tokenizer is pinned
    by digest too, exactly when it is the model's own."""
    _need(_architecture_name(m.architecture), "architecture",
          "must be non-empty and only lowercase letters, digits and _ (psyswarm or a transformers model_type)")
    embedded = m.architecture == PSYSWARM_ARCHITECTURE
    if embedded:
        _need(m.source == "", "source", "must be empty for the psyswarm architecture")
        _need(m.source_revision == "", "source_revision", "must be empty for the psyswarm architecture")
        _need(m.config_sha256 == NO_DIGEST, "config_sha256", "must be all zero for the psyswarm architecture")
        _need(m.tokenizer == Tokenizer.Bytes, "tokenizer", "must be bytes for the psyswarm architecture")
    else:
        _need(valid_source(m.source), "source",
              "must be a Hub repo id org/name or a local directory starting with /, ./, ../ or ~")
        _need(_printable(m.source_revision), "source_revision", "must be printable ASCII")
        _need(m.config_sha256 != NO_DIGEST, "config_sha256",
              f"must be the sha256 of the {m.architecture} model's config.json, not zero")
    if m.tokenizer == Tokenizer.Bytes:
        _need(m.tokenizer_sha256 == NO_DIGEST, "tokenizer_sha256", "must be all zero with the bytes tokenizer")
    else:
        _need(m.tokenizer_sha256 != NO_DIGEST, "tokenizer_sha256",
              "must be the sha256 of the model's tokenizer.json, not zero")


def validate_schedule(m: Model, total_steps: int) -> None:
    """The warmup and floor a schedule uses must fit the run; a schedule that does not use them leaves them 0,
    so one on-chain description never means two things."""
    if m.lr_schedule == Schedule.Constant:
        _need(m.warmup_steps == 0, "warmup_steps", "must be 0 with the constant schedule")
    elif m.lr_schedule == Schedule.LinearWarmup:
        _need(1 <= m.warmup_steps <= total_steps, "warmup_steps",
              f"must be between 1 and total_steps ({total_steps}) with the linear_warmup schedule")
    else:
        _need(m.warmup_steps <= total_steps - 1, "warmup_steps",
              f"must be at most total_steps - 1 ({total_steps - 1}) with the warmup_cosine schedule")
    if m.lr_schedule == Schedule.WarmupCosine:
        _need(m.lr_floor_micros <= m.learning_rate_micros, "lr_floor_micros",
              "must not exceed learning_rate with the warmup_cosine schedule")
    else:
        _need(m.lr_floor_micros == 0, "lr_floor_micros", "must be 0 unless the schedule is warmup_cosine")


def validate_grad_averaging(m: Model) -> None:
    """Each compressed mode's settings are in range with that mode and 0 without it, so one on-chain description
    never means two things; and the codec suits what it carries."""
    validate_powersgd(m)
    validate_demo(m)
    validate_grad_values(m)
    validate_whole_batch_moment(m)
    validate_gossip(m)


def validate_gossip(m: Model) -> None:
    """PowerGossip (``client.averaging.gossip``) mixes replicas that each step on their own share of the batch, in
    place of SPARTA's slices; with per-step gradient averaging the replicas are one model already. Its factors travel
    in float32, float16 or int8 (int4 is measured for SPARTA's slices alone)."""
    _need(0 <= m.gossip_rank <= limits.MAX_POWERSGD_RANK, "gossip_rank",
          f"must be between 0 (SPARTA's slices) and {limits.MAX_POWERSGD_RANK}")
    if m.gossip_rank:
        _need(m.grad_averaging == GradAveraging.Off, "gossip_rank",
              f"applies only with grad_averaging off: with {m.grad_averaging.name.lower()} the replicas step on one "
              "averaged gradient and hold one model")
        _need(m.grad_values != GradValues.Int4, "grad_values",
              "int4 carries SPARTA's slices only; with gossip_rank choose float32, float16 or int8")


def validate_whole_batch_moment(m: Model) -> None:
    """The whole batch's second moment is what a replica lacks when it steps on its own share of the batch
    (``client.pipeline.optim.BatchMoment``); with per-step gradient averaging every replica steps on the whole batch's
    gradient already."""
    if m.whole_batch_moment:
        _need(m.grad_averaging == GradAveraging.Off, "whole_batch_moment",
              f"applies only with grad_averaging off: with {m.grad_averaging.name.lower()} every replica already "
              "steps on the whole batch's gradient")


def validate_grad_values(m: Model) -> None:
    """int4 carries SPARTA's slices, whose changes since their last average survive it as well as int8's (measured:
    README, "SPARTA in int4"), and not per-step gradients: no run has measured them in it, and its rounding would
    loosen every gradient round's declared-norm limit by 57% of a part's norm (client.averaging.values)."""
    if m.grad_values == GradValues.Int4:
        _need(m.grad_averaging == GradAveraging.Off, "grad_values",
              f"int4 carries SPARTA's slices only; with grad_averaging {m.grad_averaging.name.lower()} choose "
              "float32, float16 or int8")


def validate_powersgd(m: Model) -> None:
    if m.grad_averaging == GradAveraging.PowerSGD:
        _need(1 <= m.powersgd_rank <= limits.MAX_POWERSGD_RANK, "powersgd_rank",
              f"must be between 1 and {limits.MAX_POWERSGD_RANK} with powersgd gradient averaging")
    else:
        _need(m.powersgd_rank == 0, "powersgd_rank", "must be 0 unless grad_averaging is powersgd")


DEMO_FIELDS = ("demo_chunk", "demo_topk", "demo_beta_permille")


def validate_demo(m: Model) -> None:
    """DeMo keeps fewer coefficients than a chunk holds (else it would send everything, uncompressed) and a decay
    below 1 (else its momentum would never forget)."""
    if m.grad_averaging == GradAveraging.DeMo:
        _need(2 <= m.demo_chunk <= limits.MAX_DEMO_CHUNK, "demo_chunk",
              f"must be between 2 and {limits.MAX_DEMO_CHUNK} with demo gradient averaging")
        _need(1 <= m.demo_topk <= m.demo_chunk - 1, "demo_topk",
              f"must be between 1 and demo_chunk - 1 ({m.demo_chunk - 1}) with demo gradient averaging")
        _need(0 <= m.demo_beta_permille <= limits.MAX_DEMO_BETA_PERMILLE, "demo_beta_permille",
              f"must be between 0 and {limits.MAX_DEMO_BETA_PERMILLE} (demo_beta below 1) with demo gradient "
              "averaging")
    else:
        for name in DEMO_FIELDS:
            _need(getattr(m, name) == 0, name,
                  "must be 0 unless grad_averaging is demo (leave demo_chunk, demo_topk and demo_beta out)")


def validate_checkpoint(cp: Checkpoint) -> None:
    """A starting checkpoint is fresh, or a Hub/Local one that holds every stage; P2P is only ever set by Cooldown."""
    if cp.kind == CheckpointKind.Fresh:
        if cp.repo != "" or cp.revision != "":
            raise InvalidCheckpoint("a fresh checkpoint has no repo or revision")
    elif cp.saved:
        if cp.repo == "" or not _printable(cp.repo) or not _printable(cp.revision):
            raise InvalidCheckpoint("a Hub or Local checkpoint needs a printable ASCII repo (and revision)")
    else:
        raise InvalidCheckpoint("a run cannot start from a P2P checkpoint")


def predicted_false_positive_rate(config: Config, items: int) -> float:
    """Chance that a non-member tests positive once ``items`` keys are in a filter (one key per slice)."""
    fill = 1.0 - (1.0 - 1.0 / config.bloom_bits_per_slice) ** items
    return fill ** config.bloom_slices


def valid_run_id(run_id: str) -> bool:
    """1-32 bytes of ``[A-Za-z0-9._-]``: a PDA seed, a file name and a URL path segment all at once."""
    return (1 <= len(run_id.encode()) <= limits.RUN_ID_BYTES
            and all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in run_id))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything ``state.toml`` describes: a run id, its config, its model and its starting checkpoint."""

    run_id: str
    config: Config
    model: Model
    checkpoint: Checkpoint


_CHECKPOINT_KINDS = {"fresh": CheckpointKind.Fresh, "hub": CheckpointKind.Hub, "local": CheckpointKind.Local}


def _take_section(doc: dict[str, Any], section: str, cls: type, converters: dict[str, Any],
                  derived: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read one TOML table into constructor arguments, rejecting unknown keys and wrong types by name.

    ``converters`` turn a friendly key into encoded fields; ``derived`` fields are computed, never given.
    """
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise InvalidConfig(f"[{section}] must be a table")
    known = ({f.name for f in dataclasses.fields(cls)} - set(derived)) | set(converters)
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            hint = difflib.get_close_matches(key, sorted(known), n=1)
            suggestion = f"; did you mean '{hint[0]}'?" if hint else ""
            raise InvalidConfig(f"{key}: unknown key in [{section}]{suggestion}")
        if key in converters:
            out.update(converters[key](value))
            continue
        default = getattr(cls, key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise InvalidConfig(f"{key}: must be true or false, got {value!r}")
        elif isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidConfig(f"{key}: must be an integer, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise InvalidConfig(f"{key}: must be a string, got {value!r}")
        out[key] = value
    return out


def _whole_units(key: str, value: Any, per_one: int, unit: str, below: float, *, up_to: bool = False) -> int:
    """A number in [0, ``below``) (``up_to``: [0, ``below``]) given as a decimal, in whole ``unit`` (1/``per_one``
    each): the program has no floating point, and a value that is not whole would round to something its writer did
    not ask for."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= below if up_to else 0 <= value < below):
        raise InvalidConfig(f"{key}: must be a number in [0, {below:g}{']' if up_to else ')'}, got {value!r}")
    units = round(value * per_one)
    if not math.isclose(units, value * per_one, rel_tol=1e-6, abs_tol=1e-9):
        raise InvalidConfig(f"{key}: {value!r} is not a whole number of {unit}")
    return units


def _micros(key: str, value: Any, least: int) -> int:
    """A rate given as a number, in whole millionths."""
    micros = _whole_units(key, value, 1_000_000, "millionths", 4294)
    if micros < least:
        raise InvalidConfig(f"{key}: must be at least {least / 1_000_000:f}, got {value!r}")
    return micros


def _learning_rate(value: Any) -> dict[str, int]:
    return {"learning_rate_micros": _micros("learning_rate", value, 1)}


def _lr_floor(value: Any) -> dict[str, int]:
    return {"lr_floor_micros": _micros("lr_floor", value, 0)}


def _demo_beta(value: Any) -> dict[str, int]:
    return {"demo_beta_permille": _whole_units("demo_beta", value, 1000, "thousandths", 1)}


def _audit_rate(value: Any) -> dict[str, int]:
    return {"audit_permille": _whole_units("audit_rate", value, 1000, "thousandths", 1, up_to=True)}


DEFAULT_DEMO_BETA_PERMILLE = 900
"""DeMo's β when ``state.toml`` gives none: the client's default (``GradientSettings.beta``; why 0.9 and not
Psyche's 0.999: ``client.averaging.demo``)."""


def _digest(key: str) -> Any:
    def convert(value: Any) -> dict[str, bytes]:
        if not isinstance(value, str) or len(value) != 64 or any(ch not in "0123456789abcdef" for ch in value):
            raise InvalidConfig(f"{key}: must be 64 lowercase hex characters (a sha256), got {value!r:.80}")
        return {key: bytes.fromhex(value)}
    return convert


def _choice(key: str, names: dict[str, enum.IntEnum]) -> Any:
    def convert(value: Any) -> dict[str, enum.IntEnum]:
        if not isinstance(value, str) or value not in names:
            raise InvalidConfig(f"{key}: must be one of {', '.join(names)}, got {value!r}")
        return {key: names[value]}
    return convert


MODEL_KEYS = {
    "learning_rate": _learning_rate,
    "lr_floor": _lr_floor,
    "demo_beta": _demo_beta,
    "audit_rate": _audit_rate,
    "config_sha256": _digest("config_sha256"),
    "tokenizer_sha256": _digest("tokenizer_sha256"),
    "dataset_sha256": _digest("dataset_sha256"),
    "tokenizer": _choice("tokenizer", {"bytes": Tokenizer.Bytes, "model": Tokenizer.Model}),
    "lr_schedule": _choice("lr_schedule", {"constant": Schedule.Constant, "linear_warmup": Schedule.LinearWarmup,
                                           "warmup_cosine": Schedule.WarmupCosine}),
    "grad_averaging": _choice("grad_averaging", {"off": GradAveraging.Off, "full": GradAveraging.Full,
                                                 "powersgd": GradAveraging.PowerSGD, "demo": GradAveraging.DeMo}),
    "grad_values": _choice("grad_values", {"float32": GradValues.Float32, "float16": GradValues.Float16,
                                           "int8": GradValues.Int8, "int4": GradValues.Int4}),
    "wire_codec": _choice("wire_codec", {"float32": WireCodec.Float32, "float16": WireCodec.Float16,
                                         "bfloat16": WireCodec.BFloat16, "int8": WireCodec.Int8Block}),
}
"""``[model]`` keys that are not written as their encoded field: rates as numbers, digests in hex, enums by name."""


def _mode_defaults(model_args: dict[str, Any]) -> dict[str, Any]:
    """What a ``[model]`` that leaves a mode's setting out means: DeMo's β is then the client's default, not 0 (no
    momentum at all), which a writer who left it out would not expect."""
    if model_args.get("grad_averaging") == GradAveraging.DeMo:
        return {"demo_beta_permille": DEFAULT_DEMO_BETA_PERMILLE}
    return {}


def parse_run_spec(doc: dict[str, Any], resolve_model: Callable[[Model], Model] | None = None) -> RunSpec:
    """Build and validate a RunSpec from a parsed ``state.toml``; errors name the key at fault.

    ``resolve_model``, when given, completes the model before it is validated: the CLI fills the config and
    tokenizer digests from the model's source, which the coordinator itself cannot read.
    """
    unknown = set(doc) - {"run_id", "config", "model", "checkpoint"}
    if unknown:
        raise InvalidConfig(f"{sorted(unknown)[0]}: unknown top-level key (expected run_id, [config], "
                            "[model], [checkpoint])")
    run_id = doc.get("run_id")
    if not isinstance(run_id, str) or not valid_run_id(run_id):
        raise InvalidConfig(f"run_id: must be 1-32 characters of [A-Za-z0-9._-], got {run_id!r}")

    error_rate = {"rate": DEFAULT_BLOOM_ERROR_RATE}

    def take_error_rate(value: Any) -> dict[str, int]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidConfig(f"bloom_error_rate: must be a number, got {value!r}")
        error_rate["rate"] = float(value)
        return {}

    config_args = _take_section(doc, "config", Config, {
        "bloom_error_rate": take_error_rate}, derived=("bloom_slices", "bloom_bits_per_slice"))
    max_clients = config_args.get("max_clients", Config.max_clients)
    if not isinstance(max_clients, int) or not 1 <= max_clients <= limits.MAX_CLIENTS:
        raise InvalidConfig(f"max_clients: must be between 1 and {limits.MAX_CLIENTS}")
    slices, bits = bloom_params(filter_capacity(max_clients), error_rate["rate"])
    if not BLOOM_MIN_SLICES <= slices <= BLOOM_MAX_SLICES:
        raise InvalidConfig(f"bloom_error_rate: gives {slices} slices; choose a rate between 2^-16 and 2^-10 "
                            f"(0.0000153-0.00097) so the filter uses SHA-256, which the program can compute")
    config = Config(**config_args, bloom_slices=slices, bloom_bits_per_slice=bits)
    if config.bloom_bytes > limits.MAX_BLOOM_BYTES:
        raise InvalidConfig(
            f"max_clients: a participant filter for {min(max_clients, limits.PART_CLIENTS)} clients holds "
            f"{filter_capacity(max_clients)} keys (a participant and a compute key each; a proof part covers at most "
            f"{limits.PART_CLIENTS} clients) and needs {config.bloom_bytes} bytes at bloom_error_rate "
            f"{error_rate['rate']}, more than the {limits.MAX_BLOOM_BYTES} a witness transaction has room for: lower "
            f"max_clients to {largest_max_clients(error_rate['rate'])} or raise bloom_error_rate (at most 0.00097)")
    validate_config(config)

    model_args = _take_section(doc, "model", Model, MODEL_KEYS,
                               derived=("learning_rate_micros", "lr_floor_micros", "demo_beta_permille",
                                        "audit_permille"))
    model = Model(**{**_mode_defaults(model_args), **model_args})
    if resolve_model is not None:
        model = resolve_model(model)
    validate_model(model, config)

    def take_kind(value: Any) -> dict[str, Any]:
        if value not in _CHECKPOINT_KINDS:
            raise InvalidConfig(f"kind: must be one of {sorted(_CHECKPOINT_KINDS)}, got {value!r}")
        return {"kind": _CHECKPOINT_KINDS[value]}

    checkpoint = Checkpoint(**_take_section(doc, "checkpoint", Checkpoint, {"kind": take_kind}))
    try:
        validate_checkpoint(checkpoint)
    except InvalidCheckpoint as exc:
        raise InvalidConfig(f"[checkpoint]: {exc.detail}") from None
    return RunSpec(run_id=run_id, config=config, model=model, checkpoint=checkpoint)


def load_run_spec(path: str | Path, resolve_model: Callable[[Model], Model] | None = None) -> RunSpec:
    """Read ``state.toml``; a missing file or a TOML syntax error is reported with the file's name.
    ``resolve_model`` as in ``parse_run_spec``."""
    file = Path(path)
    try:
        doc = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise InvalidConfig(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidConfig(f"{file}: not a readable TOML file ({exc})") from None
    return parse_run_spec(doc, resolve_model)
