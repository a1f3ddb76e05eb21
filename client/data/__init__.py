"""Training data addressed by sample index on every machine.

The coordinator assigns data as index ranges, so index ``i`` must mean the same tokens on every trainer.
A dataset is a token sequence cut into windows of ``seq_len + 1`` tokens (``windows``), either bytes of text
(``corpus``: the embedded standard-library corpus or local files) or pre-tokenized token files with a sidecar
that names their tokenizer (``sidecar``, ``tokens``), opened from a directory, HTTP(S) or a Hub dataset repo
(``locations``; ``download`` bounds every byte a host sends by the sidecar the run pins).
``tokenizer`` and ``tokenize`` turn text into such files.

May import: nothing outside this package.
"""

from client.data.corpus import STDLIB_SOURCE, ByteDataset, files_corpus, open_byte_dataset, stdlib_corpus
from client.data.locations import (
    DEFAULT_MAX_DATASET_BYTES,
    check_dataset_tokenizer,
    dataset_sha256,
    is_token_location,
    open_dataset,
    read_location_sidecar,
)
from client.data.sidecar import DatasetError, DatasetMissing, DatasetUnreachable, TokenizerMismatch
from client.data.tokenizer import BYTES_TOKENIZER, load_tokenizer, tokenizer_sha256
from client.data.tokens import TokenDataset
from client.data.windows import SampleDataset, WindowedDataset

__all__ = [
    "BYTES_TOKENIZER",
    "DEFAULT_MAX_DATASET_BYTES",
    "STDLIB_SOURCE",
    "ByteDataset",
    "check_dataset_tokenizer",
    "dataset_sha256",
    "DatasetError",
    "DatasetMissing",
    "DatasetUnreachable",
    "SampleDataset",
    "TokenDataset",
    "TokenizerMismatch",
    "WindowedDataset",
    "files_corpus",
    "is_token_location",
    "load_tokenizer",
    "open_byte_dataset",
    "open_dataset",
    "read_location_sidecar",
    "stdlib_corpus",
    "tokenizer_sha256",
]
