"""Unit tests of :mod:`attnopt.passes.canon`: every spelling family reads to one kind with canonical args."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from attnopt.passes.canon import Op, parse_einsum_product, read


def dynamo_graph(fn, *inputs) -> fx.GraphModule:
    """The FX graph dynamo captures for ``fn(*inputs)`` (with shapes in ``node.meta``)."""
    store: dict = {}

    def backend(gm, example_inputs):
        store["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    store["gm"].meta["argnames"] = list(inspect.signature(fn).parameters)
    return store["gm"]


def returned(fn, *inputs) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The graph and the nodes ``fn`` returns (a tuple return gives several)."""
    gm = dynamo_graph(fn, *inputs)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return gm, list(out) if isinstance(out, (tuple, list)) else [out]


def read_returned(fn, *inputs) -> list[Op | None]:
    gm, nodes = returned(fn, *inputs)
    return [read(n, gm) for n in nodes]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's inputs in the order of the function's parameters (dynamo orders them by first use)."""
    order = {f"l_{name}_": i for i, name in enumerate(gm.meta["argnames"])}
    return sorted((n for n in gm.graph.nodes if n.op == "placeholder"), key=lambda n: order[n.name])


Q = torch.randn(2, 3, 5, 4)
K = torch.randn(2, 3, 7, 4)
S = torch.randn(2, 3, 5, 7)


# ----------------------------------------------------------------------------- products


@pytest.mark.parametrize("spelling", ["at", "torch.matmul", "method", "dunder"])
def test_matmul_spellings_read_as_matmul(spelling: str) -> None:
    def f(q, k):
        kt = k.transpose(-2, -1)
        if spelling == "at":
            return q @ kt, kt
        if spelling == "torch.matmul":
            return torch.matmul(q, kt), kt
        if spelling == "method":
            return q.matmul(kt), kt
        return q.__matmul__(kt), kt

    gm, (prod, kt) = returned(f, Q, K)
    op = read(prod, gm)
    q, k = placeholders(gm)
    assert op.kind == "matmul" and op.args == (q, kt, False)
    t = read(kt, gm)
    assert t.kind == "transpose" and t.args == (k, 2, 3)  # (-2, -1) normalised


def test_bmm_reads_as_matmul() -> None:
    gm, (prod,) = returned(lambda q, k: (torch.bmm(q, k.transpose(1, 2)),), Q.flatten(0, 1), K.flatten(0, 1))
    op = read(prod, gm)
    assert op.kind == "matmul" and op.args[2] is False and op.args[0] is placeholders(gm)[0]


@pytest.mark.parametrize("eq, transposed", [
    ("bhqd,bhkd->bhqk", True),
    ("b h i d, b h j d -> b h i j", True),
    ("zyad,zycd->zyac", True),
    ("...id,...jd->...ij", True),
    ("bhqk,bhkd->bhqd", False),
])
def test_einsum_reads_as_matmul(eq: str, transposed: bool) -> None:
    b = K if transposed else torch.randn(2, 3, 4, 6)
    gm, (prod,) = returned(lambda q, k: (torch.einsum(eq, q, k),), Q, b)
    op = read(prod, gm)
    q, k = placeholders(gm)
    assert op.kind == "matmul" and op.args == (q, k, transposed)
    assert eq in op.spelling


def test_einsum_that_is_not_a_product_is_not_read() -> None:
    gm, (node,) = returned(lambda q, k: (torch.einsum("bhqd,bhkd->bhkq", q, k),), Q, K)
    assert read(node, gm) is None


@pytest.mark.parametrize("dims, kind, args", [
    ((0, 1, 3, 2), "transpose", (2, 3)),
    ((0, 2, 1, 3), "transpose", (1, 2)),
    ((0, -3, -2, -1), "permute", ((0, 1, 2, 3),)),
    ((0, 2, 3, 1), "permute", ((0, 2, 3, 1),)),
])
def test_permute_of_two_dims_is_a_transpose(dims, kind, args) -> None:
    gm, (node,) = returned(lambda x: (x.permute(*dims),), Q)
    op = read(node, gm)
    assert op.kind == kind and op.args[1:] == args and op.args[0] is placeholders(gm)[0]


def test_transpose_dims_are_sorted_and_non_negative() -> None:
    for fn in (lambda x: (x.transpose(3, 2),), lambda x: (torch.transpose(x, -1, 2),),
               lambda x: (x.swapaxes(-2, -1),)):
        gm, (node,) = returned(fn, Q)
        assert read(node, gm).args[1:] == (2, 3)


# ----------------------------------------------------------------------------- scale, add, masks


@pytest.mark.parametrize("fn, factor, how", [
    (lambda s: s * 0.125, 0.125, "mul"),
    (lambda s: 0.125 * s, 0.125, "mul"),
    (lambda s: s * (1.0 / math.sqrt(64)), 0.125, "mul"),
    (lambda s: s / math.sqrt(64), 8.0, "div"),
    (lambda s: s * 64 ** -0.5, 0.125, "mul"),
    (lambda s: torch.mul(s, 2.0), 2.0, "mul"),
    (lambda s: s.div(3.0), 3.0, "div"),
])
def test_scalar_products_read_as_scale(fn, factor, how) -> None:
    gm, (node,) = returned(lambda s: (fn(s),), S)
    op = read(node, gm)
    assert op.kind == "scale" and op.args[0] is placeholders(gm)[0]
    assert op.args[1] == pytest.approx(factor) and op.args[2] == how


def test_zero_dim_tensor_divisor_is_a_scale_with_a_node_factor() -> None:
    gm, (node,) = returned(lambda s: (s / torch.full([], 8.0),), S)
    op = read(node, gm)
    assert op.kind == "scale" and op.args[2] == "div"
    assert isinstance(op.args[1], fx.Node) and read(op.args[1], gm).kind == "factory"


def test_tensor_products_are_not_scales() -> None:
    ops = read_returned(lambda s, t: (s * t, s / t, s + t), S, torch.randn_like(S))
    assert [o.kind for o in ops] == ["mul", "div", "add"]


def test_not_canonical_arithmetic_reads_as_none() -> None:
    ops = read_returned(lambda s, t: (torch.add(s, t, alpha=2.0), torch.div(s, 2.0, rounding_mode="floor"),
                                      torch.sin(s), torch.exp(s)), S, torch.randn_like(S))
    assert ops == [None, None, None, None]


def test_masked_fill_where_and_predicates() -> None:
    bias = torch.ones(7, 7).tril().view(1, 1, 7, 7)

    def f(s, b):
        keep = b[:, :, :5, :7] == 0
        m = ~keep
        return s.masked_fill(keep, float("-inf")), torch.where(m, s, -1e9), m, keep, s.ne(0)

    gm, nodes = returned(f, S, bias)
    fill, where, m, keep, ne = (read(n, gm) for n in nodes)
    s, b = placeholders(gm)
    assert fill.kind == "masked_fill" and fill.args[0] is s and fill.args[1] is nodes[3] and fill.args[2] == -math.inf
    assert where.kind == "where" and where.args == (nodes[2], s, -1e9)
    assert m.kind == "not" and m.args == (nodes[3],)
    assert keep.kind == "eq" and keep.args[1] == 0
    sliced = keep.args[0]
    g = read(sliced, gm)
    assert g.kind == "getitem" and g.args[0] is b
    assert ne.kind == "ne" and ne.args == (s, 0)


def test_tril_triu_and_factories() -> None:
    def f(x):
        return (torch.ones(5, 7, dtype=torch.bool).tril(2), torch.full((5, 7), float("-inf")).triu(1),
                x.new_full((5, 5), float("-inf")), torch.tril(torch.ones(5, 5)))

    gm, nodes = returned(f, S)
    tril, triu, new_full, tril2 = (read(n, gm) for n in nodes)
    assert tril.kind == "tril" and tril.args[1] == 2
    assert read(tril.args[0], gm).kind == "factory" and read(tril.args[0], gm).args == (1, torch.bool)
    assert triu.kind == "triu" and triu.args[1] == 1
    assert read(triu.args[0], gm).args == (-math.inf, torch.float32)
    assert new_full.kind == "factory" and new_full.args == (-math.inf, torch.float32)
    assert tril2.kind == "tril" and tril2.args[1] == 0


def test_views_read_as_view() -> None:
    ops = read_returned(lambda x: (x.view(6, 5, 4), x.reshape(2, 3, 20), x.unsqueeze(1), torch.unsqueeze(x, 0),
                                   x[:, :, None].expand(2, 3, 2, 5, 4)), Q)
    assert [o.kind for o in ops] == ["view"] * 5


# ----------------------------------------------------------------------------- softmax, casts, dropout


@pytest.mark.parametrize("fn, dim, dtype", [
    (lambda s: F.softmax(s, dim=-1), 3, None),
    (lambda s: F.softmax(s, dim=3), 3, None),
    (lambda s: torch.softmax(s, -1), 3, None),
    (lambda s: s.softmax(-1), 3, None),
    (lambda s: s.softmax(dim=-2), 2, None),
    (lambda s: F.softmax(s, dim=-1, dtype=torch.float32), 3, torch.float32),
    (lambda s: torch.softmax(s, -1, dtype=torch.float64), 3, torch.float64),
    (lambda s: nn.Softmax(dim=-1)(s), 3, None),
])
def test_softmax_spellings(fn, dim, dtype) -> None:
    gm, (node,) = returned(lambda s: (fn(s),), S)
    op = read(node, gm)
    assert op.kind == "softmax" and op.args == (placeholders(gm)[0], dim, dtype)


def test_softmax_and_dropout_modules_read_through_the_root() -> None:
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.sm = nn.Softmax(dim=-1)
            self.drop = nn.Dropout(0.1)
            self.drop0 = nn.Dropout(0.0)
            self.drop_inplace = nn.Dropout(0.1, inplace=True)

        def forward(self, s):
            p = self.sm(s)
            return self.drop(p), self.drop0(p), self.drop_inplace(p.clone())

    m = M()
    gm = fx.symbolic_trace(m)
    mods = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    sm = read(mods["sm"], gm)
    assert sm.kind == "softmax" and sm.args[1:] == (-1, None)  # no shapes in a symbolic_trace graph: -1 kept
    assert read(mods["drop"], gm).args[1:] == (0.1, "module")
    assert read(mods["drop0"], gm).args[1:] == (0.0, "off")
    assert read(mods["drop_inplace"], gm) is None  # writes into its input: not a pure op
    assert read(mods["sm"]) is None  # a module call cannot be read without its root


@pytest.mark.parametrize("fn", [
    lambda s: s.float(), lambda s: s.to(torch.bfloat16), lambda s: s.type_as(torch.ones(1, dtype=torch.float64)),
    lambda s: s.to(dtype=torch.float16), lambda s: s.bfloat16(), lambda s: s.double(),
])
def test_casts(fn) -> None:
    gm, (node,) = returned(lambda s: (fn(s),), S)
    op = read(node, gm)
    assert op.kind == "cast" and op.args == (placeholders(gm)[0],)


def test_contiguous_and_clone_are_identity() -> None:
    ops = read_returned(lambda s: (s.transpose(1, 2).contiguous(), s.clone()), S)
    assert [o.kind for o in ops] == ["identity", "identity"]


@pytest.mark.parametrize("fn, p, mode", [
    (lambda x: F.dropout(x, 0.1, training=True), 0.1, "on"),
    (lambda x: F.dropout(x, 0.1, training=False), 0.1, "off"),
    (lambda x: F.dropout(x, 0.0, training=True), 0.0, "off"),
    (lambda x: F.dropout(x, p=0.3), 0.3, "on"),
])
def test_functional_dropout(fn, p, mode) -> None:
    gm = fx.symbolic_trace(lambda x: fn(x))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    op = read(node, gm)
    assert op.kind == "dropout" and op.args[1:] == (p, mode)


def test_inplace_functional_dropout_is_not_read() -> None:
    gm = fx.symbolic_trace(lambda x: F.dropout(x, 0.1, True, True))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert read(node, gm) is None


def test_non_nodes_and_unknown_ops_read_as_none() -> None:
    assert read(3.0) is None and read(None) is None
    ops = read_returned(lambda s: (torch.erf(s), s.sum(-1), torch.cat([s, s], -1)), S)
    assert ops == [None, None, None]


# ----------------------------------------------------------------------------- parse_einsum_product


@pytest.mark.parametrize("eq, form", [
    ("bhqd,bhkd->bhqk", ("nt",)),
    ("b h i d, b h j d -> b h i j", ("nt",)),
    ("BHQD,BHKD->BHQK", ("nt",)),
    ("hbqd,hbkd->hbqk", ("nt",)),
    ("...id,...jd->...ij", ("nt",)),
    ("bid,bjd->bij", ("nt",)),
    ("id,jd->ij", ("nt",)),
    ("bhqk,bhkd->bhqd", ("nn",)),
    ("bhqd,bhdk->bhqk", ("nn",)),
    ("ij,jk->ik", ("nn",)),
    ("...ij,...jd->...id", ("nn",)),
])
def test_parse_einsum_valid(eq: str, form) -> None:
    assert parse_einsum_product(eq) == form


@pytest.mark.parametrize("eq", [
    "bhqd,bhkd",  # no output
    "bhqd,bhkd->bhkq",  # output transposed
    "bhqd,bhkd->bqhk",  # batch letters reordered in the output
    "bhqd,hbkd->bhqk",  # batch letters reordered in an operand
    "bhqd,bhkd,bhkd->bhqk",  # three operands
    "bhqd->bhqd",  # one operand
    "bhqd,bhke->bhqk",  # contracted letters differ: a sum, not a product
    "bhqd,bhkd->bhq",  # k summed away
    "bhqq,bhkq->bhqk",  # repeated letter (diagonal)
    "...qd,bhkd->bhqk",  # ellipsis on one side only
    "bhqd,bhqd->bhqq",  # repeated output letter
    "bhqd,bhkd->bhqkd",  # no contraction
    "bh1d,bhkd->bh1k",  # not a letter
    "d,d->",  # dot product
])
def test_parse_einsum_invalid(eq: str) -> None:
    assert parse_einsum_product(eq) is None


# ----------------------------------------------------------------------------- baddbmm, unary, kv repeats, in place


@pytest.mark.parametrize("fn, beta, alpha", [
    (lambda b, q, kt: torch.baddbmm(b, q, kt), 1, 1),
    (lambda b, q, kt: torch.baddbmm(b, q, kt, beta=0, alpha=0.5), 0, 0.5),
    (lambda b, q, kt: b.baddbmm(batch1=q, batch2=kt, alpha=0.25), 1, 0.25),
])
def test_baddbmm_spellings_read_with_input_beta_alpha(fn, beta, alpha) -> None:
    q, kt = Q.flatten(0, 1), K.flatten(0, 1).transpose(1, 2)
    gm, (node,) = returned(lambda b, q, kt: (fn(b, q, kt),), torch.randn(6, 5, 7), q, kt)
    op = read(node, gm)
    b, q_, kt_ = placeholders(gm)
    assert op.kind == "baddbmm" and op.args == (b, q_, kt_, beta, alpha)


def test_tanh_reads_as_unary_and_repeat_interleave_with_normalised_dim() -> None:
    ops = read_returned(lambda s: (torch.tanh(s), s.tanh(), s.repeat_interleave(2, dim=-3)), S)
    assert [o.kind for o in ops] == ["unary", "unary", "repeat_interleave"]
    assert ops[0].args[1] == "tanh" and ops[2].args[1:] == (2, 1)


def test_inplace_methods_read_as_their_functional_kind() -> None:
    def f(s, m):
        a = s * 1.0
        return a.mul_(2.0), (s + 0).div_(3.0), (s * 1).masked_fill_(m, 0.0)

    ops = read_returned(f, S, torch.rand(5, 7) < 0.5)
    assert [o.kind for o in ops] == ["scale", "scale", "masked_fill"]
    assert ops[0].args[1:] == (2.0, "mul") and ops[1].args[1:] == (3.0, "div")


def test_functionalize_inplace_points_later_uses_at_the_inplace_node() -> None:
    from attnopt.passes.canon import functionalize_inplace

    def f(q, k):
        s = q @ k.transpose(-2, -1)
        s.div_(8.0)  # result unused: later code reads `s`
        return s.softmax(-1)

    gm = dynamo_graph(f, Q, K)
    (div,) = [n for n in gm.graph.nodes if n.target == "div_"]
    (sm,) = [n for n in gm.graph.nodes if n.target == "softmax"]
    assert sm.args[0] is not div
    assert functionalize_inplace(gm) == 1
    assert sm.args[0] is div
    args = [Q if n.name == "l_q_" else K for n in gm.graph.nodes if n.op == "placeholder"]  # graph order
    torch.testing.assert_close(gm(*args)[0], f(Q, K))


def test_functionalize_inplace_leaves_tensors_read_before_the_mutation() -> None:
    from attnopt.passes.canon import functionalize_inplace

    def f(q, k):
        s = q @ k.transpose(-2, -1)
        view = s[0]  # a view taken before the in-place op sees the mutation
        s.mul_(2.0)
        return s.softmax(-1), view

    gm = dynamo_graph(f, Q, K)
    assert functionalize_inplace(gm) == 0
