"""A mixture of experts in a cached causal LM: the router on folded rows and the dispatch sorted by expert.

Hugging Face's MoE families (Mixtral, Qwen-MoE, OLMoE, DeepSeek V3, ...) route each token on ``(B*T, C)`` rows
(softmax or sigmoid, topk, DeepSeek's group mask written with ``scatter_``, PhiMoE's two ``max`` picks joined
by ``concat``) and dispatch with ``grouped_mm``:
sort the (token, slot) pairs by expert, one product per expert on contiguous rows, then the inverse
permutation (or, ``batched_mm``, one product per row with the weights of its own expert). Written here small,
each variant is cached and gives the plain loop's tokens, ragged prompts too; what would make a row depend on
other rows (or on the batch and length being at least 2) is refused, naming the op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_generation_spellings import Base, C, assert_cached_exactly

from attnopt.generation import PositionError, cached

pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
grouped_mm = torch.ops.transformers.grouped_mm_fallback  # the grouped product HF's MoE runs on CPU in float32

E, K, HID = 4, 2, 32


class Experts(Base):
    """One attention block and a sparse MoE, the dispatch spelled as ``how`` says."""

    def __init__(self, how: str = "index_put", router: str = "softmax"):
        super().__init__()
        torch.manual_seed(1)
        self.how, self.router_kind = how, router
        self.router = nn.Linear(C, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, C, HID) * 0.2)
        self.w_out = nn.Parameter(torch.randn(E, HID, C) * 0.2)
        self.scale = nn.Parameter(torch.randn(E, 1) * 0.1 + 1)
        self.bias_out = nn.Parameter(torch.randn(E, C) * 0.1)

    def route(self, h):
        logits = self.router(h)
        if self.router_kind == "groups":  # DeepSeek V3: pick the best group of experts, then the experts
            scores = logits.sigmoid()
            best = scores.view(-1, 2, E // 2).topk(1, dim=-1)[0].sum(-1)
            mask = torch.zeros_like(best)
            mask.scatter_(1, best.topk(1, dim=-1)[1], 1)
            keep = mask.unsqueeze(-1).expand(-1, 2, E // 2).reshape(-1, E)
            idx = scores.masked_fill(~keep.bool(), float("-inf")).topk(K, dim=-1)[1]
            return scores.gather(1, idx), idx
        if self.router_kind.startswith("two-picks"):  # PhiMoE's sparsemixer: the best expert, then the best other
            w1, i1 = logits.max(dim=-1, keepdim=True)
            rest = logits.scatter(-1, i1, float("-inf"))
            w2, i2 = rest.max(dim=-1, keepdim=True)
            if self.router_kind == "two-picks-shifted":  # no longer indices below E: histc cannot be matched
                i2 = i2 + 1
            w = torch.concat((logits.softmax(-1).gather(-1, i1), rest.softmax(-1).gather(-1, i2 % E)), dim=-1)
            return w, torch.concat((i1, i2), dim=-1)
        dim = 0 if self.router_kind == "along-rows" else -1
        w, idx = logits.softmax(dim).topk(K, dim=-1)
        w /= w.sum(-1, keepdim=True)
        return w, idx

    def batched(self, h, w, idx):
        """HF's ``batched_mm`` experts: each (token, slot) row picks its expert's weights, one product per row."""
        rows = h.repeat_interleave(K, dim=0) if self.how == "batched" else h.repeat(K, 1)  # tiled: other rows
        ids = idx.reshape(-1)
        y = F.gelu(torch.bmm(rows.unsqueeze(1), self.w_in[ids]))
        y = torch.bmm(y, self.w_out[ids]).squeeze(1)
        y.add_(self.bias_out[ids])  # in place into a view nothing else reads (GPT-OSS's batched experts)
        return y * w.reshape(-1, 1) * self.scale[ids]

    def moe(self, x):
        B, T, _ = x.shape
        h = x.reshape(-1, C)
        if self.how == "cat-columns":  # each row joined back from its own halves
            h = torch.cat((h[:, :C // 2], h[:, C // 2:]), dim=-1)
        elif self.how == "cat-rows":  # rows joined along the folded axis (refused, even where it mixes nothing)
            h = torch.cat((h, h), dim=0).view(2, B * T, C).mean(0)
        w, idx = self.route(h)
        how = self.how
        if how in ("batched", "tiled"):
            return self.batched(h, w, idx).view(B * T, K, C).sum(1).view(B, T, C)
        flat = idx.reshape(-1)
        if how == "keys-aliased":  # written through the tensor it views, after the view was taken
            base = flat.clone()
            flat = base.view(-1)
            base.sub_(1)
        ids, perm = torch.sort(flat, descending=how == "descending")
        if how == "keys-out":
            torch.sub(ids * 1, 1, out=ids)
        if how == "other-sort":  # the keys of another routing: the groups are not the rows' own experts
            ids = torch.sort(self.router(h).topk(K, dim=-1, largest=False)[1].reshape(-1))[0]
        if how == "keys-written":
            ids.clamp_(max=E - 2)
        xs = h[perm // K]
        bins = E - 1 if how == "few-bins" else E
        offs = torch.cumsum(torch.histc(ids.float(), bins, 0, bins - 1), 0, dtype=torch.int32)
        y = grouped_mm(F.gelu(grouped_mm(xs, self.w_in[:bins], offs=offs)), self.w_out[:bins], offs=offs)
        y = y * w.reshape(-1)[perm].unsqueeze(-1) * self.scale[ids]
        if how == "cumsum-rows":
            y = y.cumsum(0)
        if how in ("index_put", "descending", "few-bins", "other-sort", "keys-written", "cumsum-rows", "cat-columns",
                   "cat-rows"):
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.size(0))
            y = y[inv]
        elif how == "argsort":
            y = y[perm.argsort()]
        elif how == "argsort-descending":  # not the inverse: row i gets row n - 1 - i's result
            y = y[perm.argsort(descending=True)]
        elif how == "squeeze":  # (B*T*K, C) as traced, (C,) at one token of batch 1 and top-1 routing
            y = y.view(-1, 1, C).squeeze(0).squeeze(1)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.size(0))
            y = y[inv]
        elif how == "scatter":
            out = torch.empty_like(y)
            out[perm] = y
            y = out
        return y.view(B * T, K, C).sum(1).view(B, T, C)

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.merge(self.attend(*self.heads(x)))
        return self.head(x + self.moe(x))


@pytest.mark.parametrize("how, router", [("index_put", "softmax"), ("argsort", "softmax"), ("scatter", "softmax"),
                                         ("index_put", "groups"), ("batched", "softmax"), ("index_put", "two-picks"),
                                         ("cat-columns", "softmax")],
                         ids=["inverse-by-index_put", "inverse-by-argsort", "rows-put-back", "deepseek-groups",
                              "batched-per-row", "phimoe-two-picks", "rows-joined-from-their-columns"])
def test_a_mixture_of_experts_is_cached_exactly(how, router):
    assert_cached_exactly(Experts(how, router).eval())


@pytest.mark.parametrize("how, router, op, why", [
    ("index_put", "along-rows", "aten.softmax", "works along the axis in which batch and sequence axes are folded"),
    ("descending", "softmax", "aten.histc", "counts the keys"),
    ("few-bins", "softmax", "aten.histc", "counts the keys"),
    ("other-sort", "softmax", "grouped_mm_fallback", "mixture of experts' dispatch"),
    ("keys-written", "softmax", "aten.clamp_", "writes in place into the sorted keys"),
    ("cumsum-rows", "softmax", "aten.cumsum", "mixture of experts' dispatch"),
    ("left-sorted", "softmax", "aten.view", "mixture of experts' dispatch"),
    ("tiled", "softmax", "aten.repeat", "batch and sequence axes are folded into one"),
    ("keys-aliased", "softmax", "aten.histc", "mixture of experts' dispatch"),
    ("keys-out", "softmax", "aten.", "mixture of experts' dispatch"),
    ("argsort-descending", "softmax", "aten.argsort", "mixture of experts' dispatch"),
    ("squeeze", "softmax", "aten.squeeze", "squeezes an axis whose size is not fixed"),
    ("index_put", "two-picks-shifted", "aten.", "mixture of experts' dispatch"),
    ("cat-rows", "softmax", "aten.cat", "joins tensors along the axis in which batch and sequence axes are folded"),
], ids=["softmax-over-rows", "sorted-descending", "fewer-bins-than-experts", "offsets-of-another-sort",
        "keys-written-in-place", "cumsum-over-sorted-rows", "never-put-back", "rows-tiled-not-interleaved",
        "keys-written-through-an-alias", "keys-written-by-out", "inverse-sorted-descending",
        "squeeze-of-sorted-rows", "indices-not-below-the-experts", "rows-joined-along-the-fold"])
def test_what_would_mix_rows_in_a_dispatch_is_refused(how, router, op, why):
    with pytest.raises(PositionError) as info:
        cached(Experts(how, router).eval())
    msg = str(info.value)
    assert op in msg and why in msg and "test_generation_moe.py:" in msg, msg


class WrittenTable(Base):
    """A fresh tensor written in place with token values, then sliced by the length as if it were a table."""

    def forward(self, idx):
        x = self.embed(idx)
        B, T, _ = x.shape
        m = torch.zeros(B, T, 24)
        m[:, :, :C].add_(x)  # through a view: refused on its own
        return self.block(x + m[:, :, :T].sum(-1, keepdim=True))


class AddedTable(Base):
    def forward(self, idx):
        x = self.embed(idx)
        B, T, _ = x.shape
        m = torch.zeros(B, T, 24)
        m.add_(torch.cat((x, x[..., :8]), -1))  # the tensor itself: its later readers read token values
        return self.block(x + m[:, :, :T].sum(-1, keepdim=True))


@pytest.mark.parametrize("model", [WrittenTable(), AddedTable()], ids=["through-a-view", "the-tensor-itself"])
def test_token_values_written_into_a_fresh_tensor_are_not_read_as_a_position_table(model):
    with pytest.raises(PositionError, match="sequence length|view of another tensor"):
        cached(model.eval())
