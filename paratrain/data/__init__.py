"""Data: synthetic tasks, WMT14 preprocessing, tokenizer, datasets, sampler, CIFAR-10.

``paratrain.data.loader`` turns a config into this rank's batches; the package
itself imports nothing heavy, so command-line tools that only parse stay fast.
"""
from paratrain.errors import UserError


class DataError(UserError, ValueError):
    """Data the trainer cannot use as it is; the message names the file and says what to change."""


def not_utf8(path, exc: UnicodeDecodeError) -> DataError:
    """The error for a file that is not UTF-8 text."""
    return DataError(f"{path} is not UTF-8 text ({exc.reason}: byte {exc.object[exc.start]:#04x}): convert it "
                     f"to UTF-8")
