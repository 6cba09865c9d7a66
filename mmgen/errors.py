"""Error types shown to users as one line (the CLI prints str(error) and exits non-zero)."""


class MmgenError(Exception):
    """Base of every error mmgen reports to a user: the message is the whole explanation."""


class LoadError(MmgenError):
    """A checkpoint directory or file could not be loaded: names the file and the tensor."""


class ValidationError(MmgenError):
    """A request or config value is out of range: names the field, the value and what is allowed."""
