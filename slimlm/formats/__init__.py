"""What is on disk: quantized-weight types, packing, the checkpoint formats, shards and their integrity,
atomic writes and the slimlm.json manifest. Imports nothing else of slimlm but its error type."""
