"""Exceptions raised by pyllamapool; every one carries a message meant for a person."""


class PyllamapoolError(Exception):
    """Base class: the CLI prints the message on one line and exits non-zero."""


class SourceError(PyllamapoolError):
    """The pinned source could not be obtained or failed verification."""


class PatchError(PyllamapoolError):
    """The patch series did not apply, or patches/ and vendor/ disagree."""


class ToolchainError(PyllamapoolError):
    """A compiler or SDK the requested target needs is missing."""


class BuildError(PyllamapoolError):
    """Configuring or compiling failed."""


class LibraryNotFound(PyllamapoolError):
    """The built shared libraries are not where the package looks."""
