"""The one base class of the errors a user can fix: caught once by ``paratrain.cli.main``."""


class UserError(Exception):
    """A bad config, file, checkpoint, job name or host list; the message names it and says how to fix it.

    The command line prints it as one line (``paratrain: <message>``) and exits 2, with no traceback.
    """

