"""One module per `tensegrity` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""


class UserError(Exception):
    """Bad input from the user: printed without a traceback, and the command exits with code 2."""
