"""paratrain.nn's CrossEntropyLoss against MindSpore 2.7.0's: values (a masked mean, a saturated token, no kept
token), the gradient of the logits, the output's shape."""
import numpy as np
import pytest
from mindspore.parallel import _transformer as ms_transformer

import paratrain.nn as pnn
from reference import assert_close, ms_tensor, torch_tensor

N, V = 8, 11


def cases():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((N, V)).astype(np.float32) * 3
    labels = rng.integers(0, V, N)
    mask = np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32)
    saturated = logits.copy()
    saturated[0] = 0.0
    saturated[0, labels[0]] = -100.0  # softmax 0 in fp32: -log(0 + 1e-24)
    return {"masked": (logits, labels, mask), "saturated": (saturated, labels, mask),
            "nothing kept": (logits, labels, np.zeros(N, np.float32))}


@pytest.mark.parametrize("case", list(cases()))
def test_cross_entropy_loss(case):
    import mindspore

    logits, labels, mask = cases()[case]
    ms_loss = ms_transformer.CrossEntropyLoss()
    ms_value, ms_grad = mindspore.value_and_grad(ms_loss, grad_position=0)(*(ms_tensor(x) for x in cases()[case]))
    loss = pnn.CrossEntropyLoss()
    inputs = torch_tensor(logits, requires_grad=True), torch_tensor(labels), torch_tensor(mask)
    value = loss(*inputs)
    value.sum().backward()
    assert value.shape == ms_value.shape
    assert_close(f"CrossEntropyLoss ({case}): value", value.detach().numpy(), ms_value.asnumpy())
    assert_close(f"CrossEntropyLoss ({case}): gradient", inputs[0].grad.numpy(), ms_grad.asnumpy())
