"""The tiny Llama that ``examples/tiny-llama`` and ``psyswarm demo --model tiny-llama`` train, made on this machine
with nothing downloaded:

1. a byte-level BPE tokenizer trained on the embedded corpus (the Python standard library's sources);
2. a tiny ``LlamaConfig`` ``config.json`` beside that tokenizer in ``model/`` (a model source directory);
3. the corpus tokenized into ``tokens/`` (token files + ``dataset.json``);
4. a run's ``state.toml`` naming both, with the digests of the ``config.json`` and ``tokenizer.json`` just written.

The same steps with the CLI: ``psyswarm train-tokenizer --output OUT/model --vocab 2048``, then
``psyswarm tokenize stdlib --tokenizer OUT/model --output OUT/tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

LAYERS, HEADS, KV_HEADS, HIDDEN, SEQ_LEN = 6, 4, 2, 64, 128
DEFAULT_VOCAB = 2048
PREPARED_FILE = "prepared.json"
"""Written last into a finished cache (``cached``): what it was made with, so that a changed choice remakes it."""

Progress = Callable[[str], None]

STATE_TOML = """\
# A tiny Llama (transformers LlamaForCausalLM) with its own BPE tokenizer, trained on the embedded corpus.
# Written by client/swarm/tiny_llama.py (examples/tiny-llama/prepare.py, psyswarm demo --model tiny-llama);
# the digests pin the files it wrote.
run_id = "{run_id}"

[config]
min_clients = 4              # a worker per stage (3) plus one trainer
max_clients = 16
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 20             # seconds the clients get to load the model and open the data
max_round_train_time = 120
round_witness_time = 2
cooldown_time = 10
rounds_per_epoch = {rounds_per_epoch}
total_steps = {total_steps}
global_batch_size = 32
bloom_error_rate = 0.0009

[model]
architecture = "llama"
source = "{source}"
config_sha256 = "{config_sha256}"
tokenizer = "model"
tokenizer_sha256 = "{tokenizer_sha256}"
dataset = "{dataset}"
dataset_sha256 = "{dataset_sha256}"
n_layers = {layers}
n_heads = {heads}
d_model = {hidden}
seq_len = {seq_len}
microbatch_size = 8
learning_rate = 0.003
lr_schedule = "warmup_cosine"
warmup_steps = {warmup_steps}
lr_floor = 0.0003
sparta_every = 20
sparta_partitions = 20
max_allowed_stale = 5
sync_phase1_steps = 400
sync_phase2_steps = 100

[checkpoint]
kind = "fresh"
"""


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    """A prepared tiny Llama: its model source directory and its token directory."""

    model_dir: Path
    tokens_dir: Path
    vocab_size: int
    tokens: int


def write_model_config(model_dir: Path, vocab_size: int, bos_id: int | None, eos_id: int | None) -> Path:
    """A tiny LlamaConfig: 6 layers (two per stage), 64 wide, grouped-query attention."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=2 * SEQ_LEN, bos_token_id=bos_id, eos_token_id=eos_id,
                         tie_word_embeddings=False)
    config.save_pretrained(model_dir)
    return model_dir / "config.json"


def corpus_files(max_bytes: int | None) -> list[Path]:
    """The embedded corpus's files, the first ``max_bytes`` or so of them (the files ``stdlib_texts`` reads)."""
    from client.data.corpus import stdlib_files

    chosen, seen = [], 0
    for path in stdlib_files():
        if max_bytes is not None and seen >= max_bytes:
            break
        chosen.append(path)
        seen += path.stat().st_size
    return chosen


class _Every:
    """Passes a progress line on at most once per ``seconds``, so that a long step says it is alive without
    flooding the terminal."""

    def __init__(self, progress: Progress, seconds: float = 2.0) -> None:
        self.progress, self.seconds, self.last = progress, seconds, time.monotonic()

    def __call__(self, line: str) -> None:
        if time.monotonic() - self.last >= self.seconds:
            self.last = time.monotonic()
            self.progress(line)


def _reading(texts: Iterable[str], total: int, progress: Progress) -> Iterator[str]:
    """``texts``, telling ``progress`` how many of the ``total`` files the BPE trainer has read so far."""
    tick = _Every(progress)
    for read, text in enumerate(texts, 1):
        tick(f"tokenizer: read {read} of {total} files")
        yield text
    progress("tokenizer: merging byte pairs")


def build(out: Path, *, vocab: int = DEFAULT_VOCAB, corpus_bytes: int | None = None,
          progress: Progress = print) -> TinyLlama:
    """Write the tokenizer and ``config.json`` into ``out/model`` and the tokenized corpus into ``out/tokens``."""
    from client.data.tokenize import tokenize_files
    from client.data.tokenizer import BOS_TOKEN, ModelTokenizer, stdlib_texts, train_bpe

    model_dir, tokens_dir = out / "model", out / "tokens"
    files = corpus_files(corpus_bytes)
    size = sum(path.stat().st_size for path in files)
    progress(f"tokenizer: training a {vocab}-token byte-level BPE on {len(files)} stdlib files ({size / 1e6:.1f} MB)")
    train_bpe(model_dir, vocab, _reading(stdlib_texts(corpus_bytes), len(files), progress))
    tokenizer = ModelTokenizer(model_dir)
    write_model_config(model_dir, tokenizer.vocab_size, tokenizer.token_id(BOS_TOKEN), tokenizer.eos_id)
    progress(f"model: {LAYERS} layers, {HIDDEN} wide, vocabulary {tokenizer.vocab_size}; tokenizing the corpus")
    tick = _Every(progress)
    summary = tokenize_files(files, tokenizer, tokens_dir, fmt="text",
                             on_progress=lambda done, tokens: tick(f"tokens: {done} of {len(files)} files, "
                                                                   f"{tokens:,} tokens"))
    progress(f"tokens: {summary.tokens:,} in {summary.files} file{'s' * (summary.files != 1)}")
    return TinyLlama(model_dir, tokens_dir, tokenizer.vocab_size, summary.tokens)


def state_toml(prepared: TinyLlama, *, run_id: str = "tiny-llama", rounds_per_epoch: int = 10,
               total_steps: int = 60) -> str:
    """A run of ``prepared``: its digests computed from the files as they are now; a tenth of the steps warm up."""
    from client.data import dataset_sha256, tokenizer_sha256
    from client.models import config_digest

    config = json.loads((prepared.model_dir / "config.json").read_text())
    return STATE_TOML.format(
        run_id=run_id, rounds_per_epoch=rounds_per_epoch, total_steps=total_steps, warmup_steps=total_steps // 10,
        source=prepared.model_dir, dataset=prepared.tokens_dir, layers=LAYERS, heads=HEADS, hidden=HIDDEN,
        seq_len=SEQ_LEN, config_sha256=config_digest(config).hex(),
        tokenizer_sha256=tokenizer_sha256(prepared.model_dir).hex(),
        dataset_sha256=dataset_sha256(str(prepared.tokens_dir)).hex())


def prepare(out: Path, *, vocab: int = DEFAULT_VOCAB, corpus_bytes: int | None = None,
            progress: Progress = print) -> Path:
    """Write ``out/model``, ``out/tokens`` and ``out/state.toml``; returns the state.toml path."""
    out = out.expanduser().resolve()
    prepared = build(out, vocab=vocab, corpus_bytes=corpus_bytes, progress=progress)
    state = out / "state.toml"
    state.write_text(state_toml(prepared))
    progress(f"model {prepared.model_dir} ({LAYERS} layers, vocabulary {prepared.vocab_size}); "
             f"{prepared.tokens:,} tokens in {prepared.tokens_dir}; run config {state}")
    return state


def cached(directory: Path, *, vocab: int = DEFAULT_VOCAB, corpus_bytes: int | None = None,
           progress: Progress = print) -> TinyLlama:
    """The tiny Llama in ``directory``, made there first unless an earlier call finished it with the same choices.

    It is built in a hidden directory beside ``directory`` that replaces it only once complete, so an interrupted
    preparation is made again rather than used half-written.
    """
    directory = directory.expanduser().resolve()
    choices = {"vocab": vocab, "corpus_bytes": corpus_bytes}
    found = _finished(directory, choices)
    if found is not None:
        progress(f"tiny Llama already prepared in {directory}: {found.tokens:,} tokens, vocabulary "
                 f"{found.vocab_size}")
        return found
    staging = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    built = build(staging, vocab=vocab, corpus_bytes=corpus_bytes, progress=progress)
    (staging / PREPARED_FILE).write_text(json.dumps({**choices, "vocab_size": built.vocab_size,
                                                     "tokens": built.tokens}) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    progress(f"tiny Llama prepared in {time.monotonic() - started:.0f} s, kept in {directory} for the next run")
    return dataclasses.replace(built, model_dir=directory / "model", tokens_dir=directory / "tokens")


def _finished(directory: Path, choices: dict) -> TinyLlama | None:
    """The tiny Llama ``cached`` completed in ``directory`` with these choices, or None."""
    try:
        record = json.loads((directory / PREPARED_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(key) != value for key, value in choices.items()):
        return None
    vocab_size, tokens = record.get("vocab_size"), record.get("tokens")
    if not (isinstance(vocab_size, int) and isinstance(tokens, int)):
        return None
    return TinyLlama(directory / "model", directory / "tokens", vocab_size, tokens)
