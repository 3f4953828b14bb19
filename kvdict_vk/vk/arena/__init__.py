"""The arena wing: the KV arena's memory, its layout in use and its write paths."""
