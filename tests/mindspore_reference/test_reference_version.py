"""The face follows MindSpore 2.7.0, the last release that ships the nn.transformer blocks."""
import mindspore


def test_the_reference_is_mindspore_2_7_0_with_its_transformer_blocks():
    from mindspore.parallel._transformer import Transformer, TransformerOpParallelConfig  # noqa: F401

    assert mindspore.__version__ == "2.7.0"


def test_the_transformer_package_s_names_import_from_paratrain_nn_transformer():
    import mindspore.parallel._transformer as theirs

    import paratrain.nn.transformer as ours

    public = {name for name in dir(theirs) if not name.startswith("_") and isinstance(getattr(theirs, name), type)}
    not_ported = {"FixedSparseAttention"}  # docs/mindspore.md lists it among what is not ported
    assert public - not_ported - set(ours.__all__) == set()
    assert all(hasattr(ours, name) for name in ours.__all__)
