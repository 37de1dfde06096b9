"""The matcher as a table of named rules (``attnopt.passes.find_sites.RULES``), and one refusal type.

A near miss names the rule that refused it (``record.extra["rule"]``), counts in ``REFUSALS`` and
logs a debug line; its reason is the one ``explain()`` has always shown. The mask planner's and the
position analysis' exceptions are :class:`attnopt.spec.Refusal` s like the matcher's ``NearMiss``.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import attnopt.passes.find_sites as find_sites_module
from attnopt.passes import masks, positions
from attnopt.passes.find_sites import REFUSALS, RULES, Match, NearMiss, find_sites
from attnopt.passes.shapes import ensure_shapes
from attnopt.spec import LEFT_ALONE, NOT_ATTENTION, PositionError, Refusal, SiteRecord

B, H, T, D = 2, 2, 6, 4

NAMES = (
    "softmax over the key axis",
    "probabilities reach P @ V",
    "scores come from q @ k^T",
    "conversions keep every value",
    "scale, score modifier, then masks",
    "q, k, v shapes line up",
    "heads match or are shared",
    "the output has SDPA's shape",
    "masks are planned",
    "q and k share a floating dtype",
    "fills hold in the compute dtype",
    "a sink is one more key",
    "zeroed probabilities were masked",
    "a floor at the dtype's minimum",
    "v is floating",
    "assemble the match",
    "no in-place write inside the site",
)


class Attn(nn.Module):
    """``body(q, k, v)``: one spelling of attention, right or nearly so."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, q, k, v, mask):
        return self.body(q, k, v, mask)


def sites(body) -> list[Match | SiteRecord]:
    gm = fx.symbolic_trace(Attn(body))
    inputs = (torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D),
              torch.rand(B, 1, T, T) > 0.5)
    ensure_shapes(gm, inputs)
    return find_sites(gm)


def test_the_table_lists_the_rules_in_order():
    assert tuple(name for name, _ in RULES) == NAMES
    assert all(callable(rule) for _, rule in RULES)
    # the module docstring walks the same list, in the same order
    doc = find_sites_module.__doc__
    places = [doc.find(f"*{name}*") for name in NAMES]
    assert -1 not in places, [n for n, p in zip(NAMES, places) if p == -1]
    assert places == sorted(places)


def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(D)


NEAR_MISSES = {
    # softmax over the query axis: no attention at all
    "query-axis": (lambda q, k, v, m: torch.softmax(scores(q, k), dim=-2) @ v, "softmax over the key axis",
                   "softmax is over dim 2, the query axis, not the last (key) axis of the 4-D scores", NOT_ATTENTION),
    # the probabilities are summed, never multiplied by v
    "no-pv": (lambda q, k, v, m: torch.softmax(scores(q, k), dim=-1).sum(-1), "probabilities reach P @ V",
              "the probabilities pass through `sum` before the product with values", NOT_ATTENTION),
    # the probabilities are weighted elementwise, not renormalised, before P @ V
    "weighted": (lambda q, k, v, m: (torch.softmax(scores(q, k), dim=-1) * v[..., :1].transpose(-2, -1)) @ v,
                 "probabilities reach P @ V", "the probabilities are changed by * after the softmax (a mask or "
                 "product after the softmax without renormalising)", LEFT_ALONE),
    # a fill value that is a tensor: the mask cannot be read
    "tensor-fill": (lambda q, k, v, m: torch.softmax(scores(q, k).masked_fill(m, q.mean()), dim=-1) @ v,
                    "scores come from q @ k^T", "the masked_fill value `mean` is not a number known at capture",
                    LEFT_ALONE),
    # a fill that hides nothing: the planner cannot make it one SDPA mask
    "zero-fill": (lambda q, k, v, m: torch.softmax(scores(q, k).masked_fill(m, 0.0), dim=-1) @ v,
                  "masks are planned",
                  "the mask fills scores with 0.0, which does not suppress the masked keys; left as written",
                  LEFT_ALONE),
    "divided-by-zero": (lambda q, k, v, m: torch.softmax(q @ k.transpose(-2, -1) / 0.0, dim=-1) @ v,
                        "scale, score modifier, then masks", "the scores are divided by zero", LEFT_ALONE),
    # the scores are sliced between the product and the softmax: attention left alone (it counts as a site)
    "sliced": (lambda q, k, v, m: torch.softmax(scores(q, k)[..., :3], dim=-1) @ v[:, :, :3],
               "scores come from q @ k^T", "the scores pass through getitem between the product and the softmax",
               LEFT_ALONE),
}


@pytest.mark.parametrize("case", NEAR_MISSES)
def test_a_near_miss_names_the_rule_that_refused_it(case, caplog):
    body, rule, reason, decision = NEAR_MISSES[case]
    before = REFUSALS.copy()
    with caplog.at_level(logging.DEBUG, logger="attnopt.passes.find_sites"):
        (record,) = sites(body)
    assert isinstance(record, SiteRecord), "matched"
    assert record.extra["rule"] == rule
    assert REFUSALS[rule] == before[rule] + 1
    assert sum(REFUSALS.values()) == sum(before.values()) + 1  # no other rule counted
    assert record.reason == reason  # as explain() has always worded it
    assert record.decision == decision
    assert any(rule in r.getMessage() and record.reason in r.getMessage() for r in caplog.records)


def test_a_match_names_no_rule_and_counts_nothing():
    before = REFUSALS.copy()
    (match,) = sites(lambda q, k, v, m: torch.softmax(scores(q, k).masked_fill(m, float("-inf")), dim=-1) @ v)
    assert isinstance(match, Match)
    assert "rule" not in match.record.extra
    assert REFUSALS == before
    assert match.spec.scale == pytest.approx(1 / math.sqrt(D))


def test_every_refusal_is_a_refusal():
    assert issubclass(NearMiss, Refusal)
    assert issubclass(masks._Unknown, Refusal)
    assert issubclass(positions._Refuse, Refusal)
    assert issubclass(PositionError, Refusal) and issubclass(PositionError, ValueError)
    # what they carry: the reason as the message, a decision for the record
    e = positions._Refuse("mixes positions")
    assert str(e) == "mixes positions" and e.decision == LEFT_ALONE
    assert str(masks._Unknown()) == ""


def test_the_mask_planner_refuses_with_a_refusal():
    """The band reader's "cannot read" is a Refusal, caught inside the planner: the mask goes as a tensor."""
    sym = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()
    with pytest.raises(Refusal):
        masks._order(sym, 3)


def test_every_softmax_that_feeds_a_value_product_counts_as_a_site():
    """``explain()``'s "N of M sites": an attention layer left alone counts among the M; a softmax whose
    output never reaches a product with values (a classifier head, a pooling weight) does not."""
    import attnopt

    class Three(torch.nn.Module):
        def forward(self, q, k, v):
            a = torch.softmax(scores(q, k), dim=-1) @ v  # rewritten
            b = torch.softmax(scores(q, k)[..., :3], dim=-1) @ v[:, :, :3]  # attention, left alone
            c = torch.softmax(scores(q, k), dim=-1).sum(-1)  # no product with values: not attention
            return a, b, c

    q, k, v = (torch.randn(1, 2, 6, D) for _ in range(3))
    report = attnopt.explain(Three(), q, k, v)
    assert [r.decision for r in report.records] == ["rewritten", LEFT_ALONE, NOT_ATTENTION]
    assert len(report.sites) == 2 and report.rewritten == 1
