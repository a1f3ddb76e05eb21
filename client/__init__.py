"""What a contributor runs: the CLI, backend adapters, pipeline workers and trainers, sync and witnessing."""
