"""`projection.project`: the same product as the module, in whichever orientation it runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dart_worker.target import projection
from dart_worker.target.projection import project
from tests.hypothesis_budget import examples


@settings(max_examples=examples(40), deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=3), width=st.integers(1, 48),
       out=st.integers(1, 300), strided=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_projection_equals_the_module(lead, width, out, strided, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(width, out, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out, width, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out, generator=gen))
    hidden = torch.randn(*lead, 2 * width if strided else width, generator=gen)
    if strided:  # a non-contiguous view, as `hidden[:, :1]` or every other column
        hidden = hidden[..., ::2]
    with torch.no_grad():
        expected = linear(hidden)
        got = project(hidden, linear)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_weight_first_only_for_float32_cpu_inference_of_several_rows():
    """The other orientation is taken exactly where it was measured to pay (see the module doc)."""
    linear = nn.Linear(8, 32, bias=False)
    rows = torch.randn(4, 8)
    with torch.no_grad():
        assert projection._weight_first(rows, linear)
        assert not projection._weight_first(rows[:1], linear)  # one row: a matrix-vector product either way
        assert not projection._weight_first(rows.bfloat16(), linear.bfloat16())  # bf16 CPUs keep the module
        assert not projection._weight_first(rows, nn.Linear(8, 32, bias=True))
    assert not projection._weight_first(rows, nn.Linear(8, 32, bias=False))  # training: autograd, autocast


def test_gradients_flow_through_the_module_path():
    linear = nn.Linear(8, 32, bias=False)
    hidden = torch.randn(3, 8, requires_grad=True)
    project(hidden, linear).sum().backward()
    assert hidden.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_draft_head_logits_go_through_the_projection(rows, monkeypatch):
    """The draft head's read-out uses `project` (the 16k-vocabulary head was 2x slower as a module)."""
    from dart_worker.head import draft_head
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    head = draft_head.DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    calls = []
    monkeypatch.setattr(draft_head, "project", lambda h, lin: calls.append(h.shape) or project(h, lin))
    hidden = torch.randn(2, rows, head.config.hidden_size)
    with torch.no_grad():
        logits = head.logits(hidden)
        expected = head.lm_head(head.norm(head.norm(hidden))).float()
    assert calls and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
