"""Domain errors shared by every component. Each message says what was wrong and how to fix it."""


class GraftFedError(Exception):
    """Base class of every error graft-fed raises on purpose."""


class ConfigError(GraftFedError, ValueError):
    """A configuration value is missing, unknown, malformed or inconsistent."""


class DataError(GraftFedError, ValueError):
    """A dataset or prompt file could not be read or does not have the expected shape."""


class CheckpointError(GraftFedError):
    """A checkpoint is corrupt, incomplete or does not belong to this run."""


class StorageError(GraftFedError):
    """A local database could not be written or read back: disk full, I/O error, damaged file."""
