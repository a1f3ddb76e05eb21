"""``psyswarm dht | worker | trainer``: run pipeline training standalone, without a coordinator.

A local run on one machine::

    psyswarm dht                                   # prints --initial-peer /ip4/127.0.0.1/tcp/…/p2p/…
    psyswarm worker --run-id local --stage head  --initial-peer …
    psyswarm worker --run-id local --stage body1 --initial-peer …
    psyswarm worker --run-id local --stage tail  --initial-peer …
    psyswarm trainer --run-id local --initial-peer … --steps 200

Without a coordinator, workers step on their own every ``--step-every`` samples; give the trainer the same
``--batch-size`` so that a step covers one batch. The trainer signs its requests with its ``--keypair``, and
a standalone worker serves any trainer that signs them (in a run with a coordinator, ``psyswarm run``, a
worker serves only the trainers of the current epoch). torch and hivemind are imported inside the commands
so that ``psyswarm --help`` stays fast.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.commands.options import keypair_option
from client.identity import DEFAULT_KEYPAIR_PATH

if TYPE_CHECKING:
    from client.pipeline.model import ModelConfig

InitialPeers = Annotated[
    list[str],
    typer.Option("--initial-peer", metavar="MULTIADDR", help="Multiaddr of a DHT peer (from `psyswarm dht`); "
                                                              "repeatable."),
]
Host = Annotated[str, typer.Option(help="Address to listen on; keep 127.0.0.1 unless peers are remote.")]
PublicHost = Annotated[str | None, typer.Option(
    metavar="ADDRESS", help="The address other machines reach this one at (an IP or DNS name), if not --host: "
                            "behind a router, forward this client's ports to it unchanged and fix them "
                            "[default: --host]")]
RunId = Annotated[str, typer.Option(metavar="RUN_ID", help="The run: namespace of its DHT records (required, as "
                                                           "everywhere a run is named).")]
WireCodecOption = Annotated[
    str,
    typer.Option(help="How activations and their gradients travel: float32, float16, bfloat16 or int8 (8-bit "
                 "with a scale per 64 values). A run's workers and trainers must use the same."),
]
Layers = Annotated[int, typer.Option("--layers", help="Transformer layers in the whole model.")]
Width = Annotated[int, typer.Option("--width", help="Model width (d_model).")]
Heads = Annotated[int, typer.Option("--heads", help="Attention heads.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens (bytes) per sample.")]
Stages = Annotated[int, typer.Option("--stages", help="Pipeline stages: head, body1…, tail.")]
DataSources = Annotated[list[str], typer.Option(metavar="SOURCE", help="'stdlib' or local files/directories; "
                                                                      "repeatable.")]
Seed = Annotated[
    int, typer.Option("--seed", help="Seed of the initial parameters; the same on every machine.")
]

DeviceOption = Annotated[
    str,
    typer.Option(metavar="auto|cpu|cuda[:N]", help="Where the stage computes: auto picks the first CUDA GPU if there "
                 "is one, else the CPU. bf16 autocast on GPUs that support it, fp32 weights and optimizer state."),
]


def parse_device_option(text: str) -> str:
    """The ``--device`` a worker computes on, checked against this machine (a one-line error otherwise)."""
    from client.pipeline.device import DeviceError, parse_device

    try:
        return str(parse_device(text))
    except DeviceError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None


InflightOption = Annotated[
    str,
    typer.Option(metavar="auto|N", help="Microbatches a trainer keeps in flight: auto measures the pipeline (its "
                 "calls' latency over the busiest stage's time per microbatch) and keeps it busy behind slow links; "
                 "N fixes it (1..32)."),
]


def parse_inflight_option(text: str) -> int | None:
    """``--inflight``: ``None`` for auto (the trainer measures), else a fixed count within what workers admit."""
    from client.pipeline.inflight import MAX_INFLIGHT

    value = text.strip().lower()
    if value == "auto":
        return None
    if not value.isdigit() or not 1 <= int(value) <= MAX_INFLIGHT:
        raise typer.BadParameter(f"{text!r}: give auto or a whole number from 1 to {MAX_INFLIGHT}",
                                 param_hint="--inflight")
    return int(value)


def parse_public_host(host: str, public: str | None, *, worker: bool) -> str | None:
    """Where peers are told to reach a client listening on ``host`` (``client.pipeline.addresses``): a worker's
    record names one address, so for a worker never None; else a one-line error naming the fix."""
    from client.pipeline.addresses import public_host, worker_host

    try:
        return worker_host(host, public) if worker else public_host(public)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--public-host") from None


_DEFAULTS = {"layers": 6, "width": 128, "heads": 4, "seq_len": 128, "stages": 3, "seed": 0}


class ClosedListenerNoise(logging.Filter):
    """Drops the error p2pd reports when its listening socket closes under its accept loop, which is how hivemind
    stops it: every clean stop printed an ``[ERROR]`` line that was no fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


def quiet_clean_p2p_stop() -> None:
    """Install ``ClosedListenerNoise`` on the logger hivemind passes p2pd's lines to (once)."""
    p2p = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(f, ClosedListenerNoise) for f in p2p.filters):
        p2p.addFilter(ClosedListenerNoise())


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_clean_p2p_stop()


def _model_config(layers: int, width: int, heads: int, seq_len: int, stages: int, seed: int) -> ModelConfig:
    from client.pipeline.model import ModelConfig

    try:
        return ModelConfig(
            n_layers=layers, d_model=width, n_heads=heads, seq_len=seq_len, num_stages=stages, seed=seed
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def dht_command(
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one.")] = 0,
    public_host: PublicHost = None,
) -> None:
    """Run a DHT bootstrap node: peers find each other through it; it stores no model data."""
    import signal
    import threading

    from client.pipeline.discovery import run_bootstrap

    public_host = parse_public_host(host, public_host, worker=False)
    _setup_logging()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run_bootstrap(initial_peers, host, port, stop, public_host)
    # multiprocessing's exit handler would join hivemind's DHT process, which a signal to the whole process group
    # can leave unable to answer; it is a helper that ends with its host (client.helper_processes).
    os._exit(0)


def worker_command(
    stage: Annotated[str, typer.Option(help="Stage to serve: head, body1…bodyK or tail.")],
    run_id: RunId,
    initial_peers: InitialPeers = [],  # noqa: B006
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port; 0 picks a free one.")] = 0,
    public_host: PublicHost = None,
    keypair: Annotated[Path, keypair_option("Solana keypair file of this worker: it signs its DHT records.")] = (
        DEFAULT_KEYPAIR_PATH),
    layers: Layers = _DEFAULTS["layers"],
    width: Width = _DEFAULTS["width"],
    heads: Heads = _DEFAULTS["heads"],
    seq_len: SeqLen = _DEFAULTS["seq_len"],
    stages: Stages = _DEFAULTS["stages"],
    seed: Seed = _DEFAULTS["seed"],
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 3e-3,
    step_every: Annotated[int, typer.Option(help="Take an optimizer step every N samples.")] = 32,
    max_batch: Annotated[int, typer.Option(help="Largest microbatch accepted.")] = 32,
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 0,
    announce_period: Annotated[float, typer.Option(help="Seconds between DHT re-announcements.")] = 10.0,
    wire_codec: WireCodecOption = "float32",
    device: DeviceOption = "auto",
) -> None:
    """Serve one pipeline stage: Forward/Backward/Info over gRPC, announced in the DHT.

    Without a coordinator there is no list of the run's trainers: this worker serves any trainer that signs
    its requests (with any keypair) for --run-id.
    """
    from client.identity import KeypairError, load_keypair
    from client.pipeline.model import stage_names
    from client.pipeline.optim import OptimizerConfig
    from client.pipeline.wire import WIRE_CODECS
    from client.pipeline.worker import run_worker

    reached_at = parse_public_host(host, public_host, worker=True)
    _setup_logging()
    try:
        identity = load_keypair(keypair)
    except KeypairError as exc:
        raise typer.BadParameter(str(exc), param_hint="--keypair") from None
    config = _model_config(layers, width, heads, seq_len, stages, seed)
    if stage not in stage_names(config.num_stages):
        raise typer.BadParameter(
            f"stage must be one of {', '.join(stage_names(config.num_stages))}", param_hint="--stage"
        )
    if wire_codec not in WIRE_CODECS:
        raise typer.BadParameter(f"must be one of {', '.join(WIRE_CODECS)}", param_hint="--wire-codec")
    chosen_device = parse_device_option(device)
    run_worker(
        config,
        stage,
        initial_peers=initial_peers,
        dht_host=host,
        public_host=reached_at,
        keypair=identity,
        torch_threads=threads or None,
        optimizer=OptimizerConfig(lr=lr),
        host=host,
        port=port,
        run_id=run_id,
        announce_period=announce_period,
        max_batch_size=max_batch,
        auto_step_samples=step_every,
        wire_codec=wire_codec,
        device=chosen_device,
    )


def trainer_command(
    run_id: RunId,
    initial_peers: InitialPeers = [],  # noqa: B006
    host: Host = "127.0.0.1",
    layers: Layers = _DEFAULTS["layers"],
    width: Width = _DEFAULTS["width"],
    heads: Heads = _DEFAULTS["heads"],
    seq_len: SeqLen = _DEFAULTS["seq_len"],
    stages: Stages = _DEFAULTS["stages"],
    seed: Seed = _DEFAULTS["seed"],
    data: DataSources = ["stdlib"],  # noqa: B006
    steps: Annotated[int, typer.Option(help="Batches to train.")] = 100,
    batch_size: Annotated[
        int, typer.Option(help="Samples per batch (match the workers' --step-every).")
    ] = 32,
    microbatch_size: Annotated[int, typer.Option(help="Samples per microbatch.")] = 8,
    start_index: Annotated[int, typer.Option(help="First sample index.")] = 0,
    wire_codec: WireCodecOption = "float32",
    inflight: InflightOption = "auto",
    keypair: Annotated[Path, keypair_option(
        "Solana keypair file that signs this trainer's requests; workers name it in receipts.")] = DEFAULT_KEYPAIR_PATH,
) -> None:
    """Route microbatches through the stage workers found in the DHT; holds no parameters.

    Every request is signed with --keypair; standalone workers serve any trainer that signs its requests.
    """
    from client.data import open_byte_dataset
    from client.identity import KeypairError, load_keypair
    from client.pipeline.discovery import WorkerDirectory, start_dht
    from client.pipeline.trainer import PipelineTrainer

    max_inflight = parse_inflight_option(inflight)
    _setup_logging()
    log = logging.getLogger("psyswarm.trainer")
    config = _model_config(layers, width, heads, seq_len, stages, seed)
    try:
        dataset = open_byte_dataset(data, config.seq_len)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None
    try:
        identity = load_keypair(keypair)
    except KeypairError as exc:
        raise typer.BadParameter(str(exc), param_hint="--keypair") from None
    dht = start_dht(initial_peers, host)
    try:
        trainer = PipelineTrainer(
            config,
            dataset,
            WorkerDirectory(dht, run_id, config.fingerprint()),
            keypair=identity,
            run_id=run_id,
            wire_codec=wire_codec,
            max_inflight=max_inflight,
        )
    except ValueError as exc:
        dht.shutdown()
        raise typer.BadParameter(str(exc)) from None
    try:
        for step in range(steps):
            first = start_index + step * batch_size
            result = trainer.train(range(first, first + batch_size), microbatch_size)
            tokens = batch_size * config.seq_len
            used = sorted({uid for workers in result.workers for uid in workers.values()})
            log.info(
                "batch %d/%d: loss %.4f, %.0f tokens/s, workers %s",
                step + 1,
                steps,
                sum(result.losses) / len(result.losses),
                tokens / result.seconds,
                ", ".join(used),
            )
    finally:
        trainer.close()
        dht.shutdown()


def register(app: typer.Typer) -> None:
    app.command("dht")(dht_command)
    app.command("worker")(worker_command)
    app.command("trainer")(trainer_command)
