"""The face follows MindSpore 2.7.0, the last release that ships the nn.transformer blocks."""
import mindspore


def test_the_reference_is_mindspore_2_7_0_with_its_transformer_blocks():
    from mindspore.parallel._transformer import Transformer, TransformerOpParallelConfig  # noqa: F401

    assert mindspore.__version__ == "2.7.0"
