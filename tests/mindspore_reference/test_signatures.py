"""The blocks and configs of paratrain.nn take MindSpore 2.7.0's arguments: the same names in the same positional
order, with the same defaults (numbers, switches, names, dtypes), and their forwards take the inputs of MindSpore's
``construct`` under the same names."""
import inspect

import mindspore
import pytest
from mindspore.parallel import _transformer as ms_transformer

import paratrain.nn as pnn

BLOCKS = ["VocabEmbedding", "AttentionMask", "MultiHeadAttention", "FeedForward", "TransformerEncoderLayer",
          "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder", "Transformer", "CrossEntropyLoss"]
CONFIGS = ["TransformerOpParallelConfig", "OpParallelConfig", "EmbeddingOpParallelConfig", "MoEConfig",
           "TransformerRecomputeConfig"]


def undecorated(function):
    """The function MindSpore's argument-checking decorators wrap (they take ``**kwargs``), found in their
    closures."""
    while list(inspect.signature(function).parameters)[-1:] == ["kwargs"]:
        function = next(cell.cell_contents for cell in function.__closure__ or ()
                        if inspect.isfunction(cell.cell_contents))
    return function


def parameters(function) -> list[inspect.Parameter]:
    """``function``'s parameters after ``self`` that may be given by position or name (not paratrain's own
    keyword-only options or ``**settings``)."""
    return [p for p in list(inspect.signature(function).parameters.values())[1:]
            if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]


def comparable(default):
    """A default as both libraries can spell it: a dtype by its name, a number, switch, string or None as it is,
    a recompute config that recomputes nothing as "none", anything else (a config object) as its type's name."""
    if isinstance(default, mindspore.dtype.Type) or "torch." in repr(default):
        return str(default).lower().replace("torch.", "")
    if default is None or isinstance(default, (bool, int, float, str)):
        return default
    if type(default).__name__ == "TransformerRecomputeConfig" and not default.recompute:
        return "none"  # MindSpore's default recompute config recomputes nothing: paratrain's "none"
    return type(default).__name__


@pytest.mark.parametrize("name", BLOCKS + CONFIGS)
def test_init_takes_mindspores_arguments(name):
    ms_params = parameters(undecorated(getattr(ms_transformer, name).__init__))
    params = parameters(getattr(pnn, name).__init__)
    assert [p.name for p in params[:len(ms_params)]] == [p.name for p in ms_params]
    assert all(p.default is not p.empty for p in params[len(ms_params):])  # paratrain's own options, at the end
    defaults = [comparable(p.default) for p in params[:len(ms_params)]]
    assert defaults == [comparable(p.default) for p in ms_params]


@pytest.mark.parametrize("name", BLOCKS)
def test_forward_takes_mindspores_inputs(name):
    ms_inputs = list(inspect.signature(getattr(ms_transformer, name).construct).parameters)
    assert list(inspect.signature(getattr(pnn, name).forward).parameters) == ms_inputs
