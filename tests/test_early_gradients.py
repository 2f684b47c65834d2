"""``sum_with_early_gradients``: a sum of terms whose gradients are taken as each is computed.
The reference is the same sum built whole and differentiated by autograd: the same value and
the same gradient for every input, shared input and parameter, under any linear use."""

from __future__ import annotations

import pytest
import torch

from dsa_train.models.early_gradients import sum_with_early_gradients


def make(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(12, 3, dtype=torch.float64, generator=g, requires_grad=True)
    shared_source = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)  # used inside a term, not an input
    return source, shared_source, scale


def term(x, candidates, scale):
    return (scale * x @ candidates.T).logsumexp(1).sum() + (x**2).sum()


def test_value_and_every_gradient_match_the_whole_sum_under_a_linear_use():
    source, shared_source, scale = make()
    rows, candidates = source * 2, shared_source.tanh()  # inputs inside a graph, as gathered rows are
    whole = term(rows, candidates, scale)
    (3 * whole + source.sum()).backward()
    want = [t.grad.clone() for t in (source, shared_source, scale)]
    for t in (source, shared_source, scale):
        t.grad = None

    rows, candidates = source * 2, shared_source.tanh()
    terms = [(lambda x, c: term(x, c, scale), (rows[s : s + 5],)) for s in range(0, 12, 5)]
    early = sum_with_early_gradients(terms, (candidates,), [scale])
    assert early.item() == pytest.approx(whole.item(), rel=1e-14)
    (3 * early + source.sum()).backward()
    for got, expected in zip((source.grad, shared_source.grad, scale.grad), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_a_parameter_a_term_does_not_use_gets_no_gradient_and_no_graph_is_kept():
    source, shared_source, scale = make(1)
    unused = torch.zeros(4, requires_grad=True)
    terms = [(lambda x, c: term(x, c, 1.0), (source[s : s + 4],)) for s in range(0, 12, 4)]
    loss = sum_with_early_gradients(terms, (shared_source,), [unused])
    loss.backward()
    assert unused.grad is None and source.grad is not None and shared_source.grad is not None


def test_without_autograd_the_terms_are_summed():
    source, shared_source, scale = make(2)
    with torch.no_grad():
        terms = [(lambda x, c: term(x, c, scale), (source[s : s + 6],)) for s in (0, 6)]
        loss = sum_with_early_gradients(terms, (shared_source,), [scale])
        assert not loss.requires_grad
        assert loss.item() == pytest.approx(term(source, shared_source, scale).item(), rel=1e-14)


def test_no_terms_is_an_error():
    with pytest.raises(ValueError, match="no terms"):
        sum_with_early_gradients([], ())
