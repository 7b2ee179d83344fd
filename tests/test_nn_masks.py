"""paratrain.nn stacks recognise their self-attention mask once per forward: a causal 0/1 mask (B, T, T) or
(B, 1, T, T) runs as SDPA's is_causal; causal x key padding (sequences padded at the end) runs its first rows,
up to the shortest sequence's length, as is_causal and the others with their score bias; any other mask runs
with its score bias; a bias is made once. Every way, the outputs and gradients are those of each layer given
the mask itself (fp32)."""
import pytest
import torch
import torch.nn.functional as F

from paratrain.modules import transformer as shared
from paratrain.nn import TransformerDecoder, TransformerEncoder, layers

B, T, S, H, HEADS, FFN, LAYERS = 3, 7, 5, 16, 4, 32, 3


def encoder():
    torch.manual_seed(0)
    return TransformerEncoder(batch_size=B, num_layers=LAYERS, hidden_size=H, ffn_hidden_size=FFN, seq_length=T,
                              num_heads=HEADS, attention_dropout_rate=0.0, hidden_dropout_rate=0.0)


def causal_times_padding(lengths: list[int], bool_4d: bool = False) -> torch.Tensor:
    """The tutorial's mask: causal (T, T) expanded over the rows, times each row's key padding."""
    keep = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    mask = torch.ones(T, T).tril().expand(B, T, T) * keep[:, None, :]
    return (mask.unsqueeze(1) != 0) if bool_4d else mask


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The keyword arguments of every SDPA call of the shared attention."""
    calls, original = [], F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(shared.F, "scaled_dot_product_attention", recorded)
    return calls


def outputs_and_gradients(stack, run) -> tuple:
    """``run(stack, x)``'s output and the gradients of its sum (input's and every parameter's)."""
    torch.manual_seed(1)
    x = torch.randn(B, T, H, requires_grad=True)
    stack.zero_grad(set_to_none=True)
    out = run(stack, x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad for p in stack.parameters()]


def layer_by_layer(mask):
    """Each layer given the mask tensor itself: the path of a mask no stack looked at."""
    def run(stack, x):
        for block in stack.blocks:
            x, _ = block(x, mask)
        return x
    return run


def assert_same(got, want):
    (out, grad_x, grads), (want_out, want_grad_x, want_grads) = got, want
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_x, want_grad_x, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bool_4d", [False, True], ids=["float_BTT", "bool_B1TT"])
def test_a_causal_mask_runs_as_is_causal_with_the_same_outputs_and_gradients(sdpa_calls, bool_4d):
    stack, mask = encoder(), causal_times_padding([T] * B, bool_4d)
    assert layers.recognise_mask(mask).causal
    got = outputs_and_gradients(stack, lambda s, x: s(x, mask)[0])
    assert [c.get("is_causal") for c in sdpa_calls] == [True] * LAYERS
    assert all(c.get("attn_mask") is None for c in sdpa_calls)
    sdpa_calls.clear()
    want = outputs_and_gradients(stack, layer_by_layer(mask))
    assert [c.get("is_causal", False) for c in sdpa_calls] == [False] * LAYERS  # the mask's bias, every layer
    assert_same(got, want)


def mindspores_attention_mask(lengths: list[int]) -> torch.Tensor:
    """MindSpore's AttentionMask of the rows' input masks: causal x query padding x key padding."""
    return layers.AttentionMask(T)((torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float())


@pytest.mark.parametrize("make_mask", [causal_times_padding, mindspores_attention_mask],
                         ids=["key_padding", "query_and_key_padding"])
def test_causal_times_padding_runs_its_first_rows_as_is_causal_and_the_rest_with_their_bias_made_once(
        sdpa_calls, monkeypatch, make_mask):
    stack, mask = encoder(), make_mask([T, 4, 5])
    made = []
    monkeypatch.setattr(layers, "score_bias", lambda m, dtype, _o=layers.score_bias: made.append(1) or _o(m, dtype))
    recognised = layers.recognise_mask(mask)
    assert recognised.causal_rows == 4 and not recognised.causal  # the shortest sequence's length
    got = outputs_and_gradients(stack, lambda s, x: s(x, mask)[0])
    assert len(made) == 1  # one bias, for the rows after the causal ones
    assert [c.get("is_causal", False) for c in sdpa_calls] == [True, False] * LAYERS
    biases = {id(c["attn_mask"]) for c in sdpa_calls[1::2]}
    assert len(biases) == 1 and sdpa_calls[1]["attn_mask"].shape == (B, 1, T - 4, T)  # every layer the same one
    made.clear()
    assert_same(got, outputs_and_gradients(stack, layer_by_layer(mask)))
    assert len(made) == LAYERS  # the layers given the mask itself make it each


def test_a_padded_mask_whose_first_row_is_not_causal_runs_with_its_whole_bias(sdpa_calls):
    stack, mask = encoder(), causal_times_padding([T, 0, 5])  # a sequence of padding only: no causal row
    assert layers.recognise_mask(mask).causal_rows == 0
    got = outputs_and_gradients(stack, lambda s, x: s(x, mask)[0])
    assert all(not c.get("is_causal", False) and c["attn_mask"].shape == (B, 1, T, T) for c in sdpa_calls)
    assert_same(got, outputs_and_gradients(stack, layer_by_layer(mask)))


@pytest.mark.parametrize("mask", [torch.ones(B, T, T), torch.ones(T, T).triu().expand(B, T, T),
                                  (torch.rand(B, T, T, generator=torch.Generator().manual_seed(3)) > 0.4).float()],
                         ids=["all_ones", "anti_causal", "random"])
def test_a_mask_that_is_not_causal_falls_back_to_its_bias(sdpa_calls, mask):
    stack = encoder()
    assert not layers.recognise_mask(mask).causal
    got = outputs_and_gradients(stack, lambda s, x: s(x, mask)[0])
    assert all(not c.get("is_causal", False) for c in sdpa_calls)
    assert_same(got, outputs_and_gradients(stack, layer_by_layer(mask)))


def test_what_is_not_a_square_plain_mask_is_given_back_as_it_is():
    for mask in (None, torch.ones(B, T, S), torch.ones(B, 2, T, T), torch.ones(B, T, T, device="meta"),
                 torch.ones(0, T, T)):
        assert layers.recognise_mask(mask) is mask


def test_the_decoder_recognises_its_self_attention_mask_and_keeps_the_memory_mask(sdpa_calls):
    torch.manual_seed(0)
    stack = TransformerDecoder(num_layers=2, batch_size=B, hidden_size=H, ffn_hidden_size=FFN, src_seq_length=S,
                               tgt_seq_length=T, num_heads=HEADS, attention_dropout_rate=0.0, hidden_dropout_rate=0.0)
    memory = torch.randn(B, S, H)
    mask, memory_mask = causal_times_padding([T] * B), torch.ones(B, T, S)

    def whole(s, x):
        return s(x, mask, memory, memory_mask)[0]

    def by_layer(s, x):
        for block in s.blocks:
            x, _ = block(x, mask, memory, memory_mask)
        return x

    got = outputs_and_gradients(stack, whole)
    assert [c.get("is_causal", False) for c in sdpa_calls] == [True, False] * 2  # self-attention, cross
    assert_same(got, outputs_and_gradients(stack, by_layer))


def test_under_autocast_the_blocks_outputs_skip_the_cast_back_with_the_same_sums(monkeypatch):
    """Under bf16 autocast a block's output stays bf16 (no round trip to fp32 through memory): the stack's outputs
    and gradients are those of blocks that cast back to fp32, as the residual adds promote to fp32 anyway."""
    stack, mask = encoder(), causal_times_padding([T, 4, 5])

    def run(s, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return s(x, mask)[0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        block_output = stack.blocks[0].attention(torch.randn(B, T, H), torch.randn(B, T, H), torch.randn(B, T, H),
                                                 torch.ones(B, T, T))[0]
    assert block_output.dtype == torch.bfloat16
    got = outputs_and_gradients(stack, run)
    monkeypatch.setattr(layers, "in_input_dtype", lambda output, dtype: output.to(dtype))  # the cast back
    want = outputs_and_gradients(stack, run)
    assert got[0].dtype == want[0].dtype == torch.float32
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        assert torch.equal(g, w)
