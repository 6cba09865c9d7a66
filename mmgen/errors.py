"""Error types shown to users as one line (the CLI prints str(error) and exits non-zero)."""


class MmgenError(Exception):
    """Base of every error mmgen reports to a user: the message is the whole explanation."""


class LoadError(MmgenError):
    """A checkpoint directory or file could not be loaded: names the file and the tensor."""


class ValidationError(MmgenError):
    """A request or config value is out of range: names the field, the value and what is allowed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so the same cleanup runs (temp files, ffmpeg)."""


def one_line(err: BaseException, *, typed: bool = False) -> str:
    """An error's message on one line (runs of whitespace, newlines too, collapsed; its type's name when
    it has no message). typed: an error that is no MmgenError (an unexpected one: a KeyError, a CUDA
    error) is prefixed by its type's name, as job records, worker reports and tables show it."""
    text = " ".join(str(err).split())
    if typed and not isinstance(err, MmgenError):
        return f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text or type(err).__name__
