"""Prepare the tiny-Llama example: everything made here, nothing downloaded.

The work is ``client.swarm.tiny_llama.prepare`` (``psyswarm demo --model tiny-llama`` runs the same): a BPE
tokenizer trained on the embedded corpus, a tiny ``LlamaConfig`` beside it in ``OUT/model``, the corpus tokenized
into ``OUT/tokens``, and ``OUT/state.toml``, a local run of that model with the digests of the files just written.

    python examples/tiny-llama/prepare.py --out ~/tiny-llama
    psyswarm validate-config ~/tiny-llama/state.toml
"""

from __future__ import annotations

import argparse
from pathlib import Path

from client.swarm.tiny_llama import DEFAULT_VOCAB, prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write model/, tokens/, state.toml")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="BPE vocabulary size")
    parser.add_argument("--corpus-bytes", type=int, default=None, help="use about this much of the corpus")
    args = parser.parse_args()
    prepare(args.out, vocab=args.vocab, corpus_bytes=args.corpus_bytes)


if __name__ == "__main__":
    main()
