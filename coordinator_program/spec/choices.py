"""The enumerated settings of a run's model description (``config.Model``): how text becomes tokens, the learning
rate's schedule, per-step gradient averaging and how its values travel, and how activations travel between stages.

Each is stored on chain as one byte (``layout.Enum8``), named in ``state.toml`` by a lowercase name
(``config.MODEL_KEYS``), and re-exported by ``config``, where the rest of the description lives.
"""

from __future__ import annotations

import enum


class Tokenizer(enum.IntEnum):
    """How text becomes token ids."""

    Bytes = 0  # byte-level: psyswarm's embedded model
    Model = 1  # the model source's own tokenizer (tokenizer.json)


class Schedule(enum.IntEnum):
    """The learning rate's course over the run's steps (``coordinator_program.spec.schedule``)."""

    Constant = 0
    LinearWarmup = 1
    WarmupCosine = 2


class GradAveraging(enum.IntEnum):
    """Per-step gradient averaging among a stage's workers."""

    Off = 0
    Full = 1
    PowerSGD = 2
    DeMo = 3


class GradValues(enum.IntEnum):
    """How averaged values travel: float32 as computed, float16 (hivemind's Float16Compression, elementwise), or
    int8 or int4 in blocks with one float32 scale each (client.averaging.values); per-step gradients as they are
    (int4 excepted: config.validate_grad_values), SPARTA's slices as their change since they were last averaged
    (client.averaging.anchored)."""

    Float32 = 0
    Float16 = 1
    Int8 = 2
    Int4 = 3


class WireCodec(enum.IntEnum):
    """How activations and their gradients travel between pipeline stages."""

    Float32 = 0
    Float16 = 1
    BFloat16 = 2
    Int8Block = 3
