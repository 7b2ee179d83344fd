"""The one base class of the errors a user can fix: caught once by ``paratrain.cli.main``."""


class UserError(Exception):
    """A bad config, file, checkpoint, job name or host list; the message names it and says how to fix it.

    The command line prints it as one line (``paratrain: <message>``) and exits 2, with no traceback.
    """


def scalar_loss(output):
    """``output`` as a 0-dim loss tensor; a net output of more than one value is refused (a ``UserError``)."""
    if output.numel() != 1:
        raise UserError(f"the net returned a tensor of shape {list(output.shape)}, not a loss: reduce it to a "
                        f"scalar, or give Model a loss_fn")
    return output.reshape(())
