"""One exception type for everything a user can get wrong or must fix by hand."""


class InfinikvError(Exception):
    """A problem the user can fix; its message is one line and names the fix.

    The CLI prints it without a traceback and exits with ``exit_code``.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
