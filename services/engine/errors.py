"""Error types the engine raises to its callers."""


class ModelFileNotFoundError(FileNotFoundError, ValueError):
    """A model file or directory that is missing: catchable as FileNotFoundError or ValueError."""
