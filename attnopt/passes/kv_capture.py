"""Capture passes for the KV cache: a causal LM's ``forward(idx)`` as one ATen graph, and what it may cache.

* :func:`capture_lm`: ``torch.export`` with dynamic batch and length, returning only the logits
  (:func:`logits_of` picks them from a tensor, a tuple or ``.logits``), tidied so that export's
  spellings read like the model's; a required ``attention_mask`` becomes ones of the tokens' shape
  (:func:`forward_kwargs` gives the same to the plain loop);
* :func:`not_cacheable`: why a matched site cannot attend to a cache (no causal proof, dropout,
  run-time conditions, a finite fill with a score modifier), or None (a proven causal sliding window is
  cached; a finite fill such as ``-1e4`` is cached under the bound the site checks on every call,
  :meth:`~attnopt.runtime.kv_cache.KVCacheAttention.check_fill`);
* :func:`mask_check`: the run-time :class:`~attnopt.runtime.kv_cache.MaskCheck` for a mask of sizes alone;
* :func:`config_max`, :func:`resolve_max_len`, :func:`cache_bytes_per_token`: how long the caches are
  and what a position costs at a site.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.operator_schemas import normalize_function

from ..runtime.kv_cache import MaskCheck
from ..spec import AttentionSpec
from .canon import may_alias, meta_value, returns_fresh, shape_of, writes
from .find_sites import Match
from .masks import Add
from .positions import PositionError, PositionPlan

aten = torch.ops.aten

#: Config attributes that name a model's maximum number of positions, most specific first.
_CONFIG_MAX = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")


def not_cacheable(spec: AttentionSpec, mask_checked: bool = False) -> str | None:
    if spec.sink and spec.score_mod is not None:
        return "has an attention sink and a score modifier together, which the cache does not apply yet"
    if spec.causal is None and not mask_checked:
        mask = "it has no mask" if spec.mask == "none" else f"its {spec.mask} mask is not proven causal"
        return f"is not proven to be causal self-attention ({mask})"
    if spec.dropout_mode == "on":
        return "has active dropout (call model.eval() before generating)"
    if spec.conditions:
        return ("is causal only while a mask term computed at run time (e.g. a padding mask) hides no key, "
                "which the cache cannot check")
    if spec.fill_value is not None and spec.score_mod is not None:  # (find_sites refuses it too; kept as a guard)
        return (f"fills masked scores with the finite value {spec.fill_value:g} and modifies the scores, which the "
                "cache's per-call bound on the fill does not cover")
    return None


def needs_mask(model: nn.Module) -> bool:
    """``model.forward`` requires an ``attention_mask`` argument (no default)."""
    p = inspect.signature(model.forward).parameters.get("attention_mask")
    return p is not None and p.default is inspect.Parameter.empty


def forward_kwargs(model: nn.Module, idx: torch.Tensor) -> dict[str, Any]:
    """What ``forward(idx, **kw)`` needs besides the tokens: an all-ones ``attention_mask`` where it is required
    (one sequence alone has no padding; a ragged batch's padding is the cache's to hide)."""
    return {"attention_mask": torch.ones_like(idx)} if needs_mask(model) else {}


@contextlib.contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[None]:
    """Put back the very objects a module's attributes held: ``torch.export`` sets a module's dicts and tuples
    (``self.opts = {...}``) back as equal copies after tracing, which would part them from the references the
    user (a closure, another module) holds to them, and from what the cached model's watch pins."""
    held = [(m.__dict__, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for now, before in held:
            for name, value in before.items():
                if now.get(name, _GONE) is not value:
                    now[name] = value


_GONE = object()


def _inline_grad_mode_blocks(module: fx.GraphModule) -> None:
    """Replace each ``wrap_with_set_grad_enabled(mode, body, *args)`` (a ``with torch.enable_grad():`` block in
    forward, or ``no_grad`` when exported with gradients) by its body's ops. Grad mode decides what autograd
    records, never a value, and the cached model runs without gradients: the block computes the same there."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = module.graph
    for node in [n for n in graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]:
        body_ref = node.args[1]
        body = getattr(module, str(body_ref.target), None) if isinstance(body_ref, fx.Node) \
            and body_ref.op == "get_attr" else None
        if not isinstance(body, fx.GraphModule):
            continue
        env: dict[fx.Node, Any] = {}
        inputs = iter(node.args[2:])
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(inputs)
                elif inner.op == "get_attr":  # a constant of the body: registered on the module under a new name
                    name = f"_{body_ref.target}_{inner.target}".replace(".", "_")
                    if not hasattr(module, name):
                        value = getattr(body, str(inner.target))
                        if isinstance(value, torch.Tensor):
                            module.register_buffer(name, value)
                        else:
                            setattr(module, name, value)
                    env[inner] = graph.get_attr(name)
                    env[inner].meta.update(inner.meta)
                elif inner.op == "output":
                    outs = inner.args[0]
                else:
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        results = fx.node.map_arg(outs, env.__getitem__)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)
            if not body_ref.users:
                graph.erase_node(body_ref)
    graph.lint()
    module.recompile()


@contextlib.contextmanager
def _no_cache_object(model: torch.nn.Module, signature: inspect.Signature, kwargs: dict[str, Any]) -> Iterator[None]:
    """``config.use_cache = False`` while exporting a Hugging Face model whose forward takes ``use_cache`` only
    through ``**kwargs`` (GraniteMoe's causal LM) and reads it from its config: a cache object in the output is
    not part of the logits, and ``torch.export`` cannot pass a keyword through ``**kwargs`` with dynamic shapes.
    The flags are put back afterwards (the cached graph never reads them)."""
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or not takes_kwargs or config is None:
        yield
        return
    try:  # (``get_text_config`` raises for a config with several candidate sub-configs)
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
    except Exception:  # noqa: BLE001 - no single text config: the top-level one only
        text = None
    configs = [config, text]
    configs = [c for i, c in enumerate(configs) if c is not None and hasattr(c, "use_cache")
               and all(c is not d for d in configs[:i])]
    if not configs:
        yield
        return
    before = [c.use_cache for c in configs]
    try:
        for c in configs:
            c.use_cache = False
        yield
    finally:
        for c, v in zip(configs, before):
            c.use_cache = v


def capture_lm(model: nn.Module, example_len: int) -> tuple[fx.GraphModule, fx.Node, Any]:
    """``forward(idx)`` as an ATen graph with symbolic batch and length, returning only the logits.

    A required ``attention_mask`` is captured as an input of the tokens' shape and then replaced in the graph by
    ones of that shape (:func:`forward_kwargs`): the mask terms it builds hide no key, which the site's mask
    proof reads from the graph; padding in ragged batches is the cache's own key mask.
    """
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    example = torch.zeros(2, example_len, dtype=torch.long, device=device)
    dim = torch.export.Dim.AUTO
    signature = inspect.signature(model.forward)
    params = list(signature.parameters)
    # Hugging Face models build their own cache object unless told not to; it is not part of the logits. Some
    # take ``use_cache`` only through ``**kwargs`` (GraniteMoe's causal LM) and read it from their config.
    kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in params else {}
    dynamic = {params[0]: {0: dim, 1: dim}, **{k: None for k in kwargs}} if params else None
    if needs_mask(model):
        kwargs["attention_mask"] = forward_kwargs(model, example)["attention_mask"]
        dynamic = {**(dynamic or {}), "attention_mask": {0: dim, 1: dim}}
    try:
        # under no_grad, as the cached model runs: a ``with torch.no_grad()`` block in forward (PhiMoE's router)
        # is then no grad-mode switch, which export would keep as a higher-order op around its body
        with _attributes_kept(model), _no_cache_object(model, signature, kwargs), torch.no_grad():
            ep = torch.export.export(model, (example,), kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        raise RuntimeError(f"torch.export could not capture {type(model).__name__}.forward(idx) with a dynamic "
                           f"batch and sequence length: {type(e).__name__}: {e}") from e
    if ep.graph_signature.buffers_to_mutate:
        raise PositionError(f"{type(model).__name__}.forward writes its buffers "
                            f"({', '.join(ep.graph_signature.buffers_to_mutate.values())}); a model that keeps "
                            "state between calls cannot be cached by attnopt")
    module = ep.module()
    graph = module.graph
    _inline_grad_mode_blocks(module)
    written = written_state(graph)
    if written:  # (``buffers_to_mutate`` can be empty while the graph writes a buffer in place: torch 2.13)
        raise PositionError(f"{type(model).__name__}.forward writes its buffers or parameters ({', '.join(written)}); "
                            "a model that keeps state between calls cannot be cached by attnopt")
    graph._codegen = fx.graph.CodeGen()  # plain forward(tokens, ...) -> logits, no pytree wrapping
    excluded, bounds = shape_guards(model, ep, params[0] if params else "idx")
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)  # the input checks: read above (shape_guards); the cache checks max_len itself
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if "attention_mask" in kwargs:
        _mask_of_ones(model, graph, placeholders)
    for extra in placeholders[1:]:  # use_cache=False: specialised at capture, unused
        if not extra.users:
            graph.erase_node(extra)
            placeholders.remove(extra)
    if len(placeholders) != 1:
        raise PositionError(f"{type(model).__name__}.forward(idx) was captured with {len(placeholders)} inputs; "
                            "only forward(idx) with token ids (and a required attention_mask) is supported")
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    sentinels = [torch.empty(0) for _ in flat]
    try:
        chosen = logits_of(pytree.tree_unflatten(sentinels, ep.call_spec.out_spec))
        index = next(i for i, s in enumerate(sentinels) if s is chosen)
    except (TypeError, StopIteration) as e:
        raise PositionError(f"{type(model).__name__}.forward must return logits: a tensor, a tuple whose first "
                            "item is the logits, or an object with .logits") from e
    out.args = (flat[index],)
    gm = fx.GraphModule(module, graph, class_name=f"Cached{type(model).__name__}")
    _tidy(gm)
    gm.meta["excluded_sizes"] = excluded
    gm.meta["length_bounds"] = bounds
    return gm, placeholders[0], ep


_SIZE = r"L\['(\w+)'\]\.size\(\)\[(\d+)\]"
_BOUND = re.compile(rf"^{_SIZE} (<=|<|!=) (\d+)$")
_SAME = re.compile(rf"^{_SIZE} == {_SIZE}$")


def _unwrap(text: str) -> str:
    """``text`` without parentheses around the whole of it."""
    while text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, c in enumerate(text):
            depth += (c == "(") - (c == ")")
            if depth == 0 and i < len(text) - 1:
                return text  # the first parenthesis closes before the end: ``(a) == (b)``
        text = text[1:-1].strip()
    return text


#: Conditions on the length alone are evaluated at every length from 1 to this; a model served longer
#: sequences than that on such a condition is not (``max_len`` is bounded by it).
LENGTHS_CHECKED = 1 << 16
#: At most this many single lengths a condition excludes are compared by the probe (``pipeline.kv``).
_MAX_EXCLUDED = 8
_SIZE_ANY = re.compile(_SIZE)
_ARITHMETIC = {"max": max, "min": min, "abs": abs}


def _length_condition(text: str, tokens: str) -> Callable[[int], bool] | None:
    """``text`` as a function of the length ``T`` when it reads no other size and only arithmetic, else None."""
    refs = _SIZE_ANY.findall(text)
    if not refs or any(name not in (tokens, "attention_mask") or dim != "1" for name, dim in refs):
        return None
    try:
        code = compile(_SIZE_ANY.sub("T", text), "<torch.export condition>", "eval")
    except SyntaxError:
        return None
    if set(code.co_names) - {"T", *_ARITHMETIC}:
        return None
    def holds(T: int) -> bool:
        try:
            return bool(eval(code, {"__builtins__": {}}, {**_ARITHMETIC, "T": T}))  # noqa: S307 - export's code
        except (ArithmeticError, ValueError, TypeError):  # ``12 // (T - 1)`` at T = 1: not the traced path there
            return False

    return holds


def _length_bound(model: nn.Module, text: str, holds: Callable[[int], bool]) -> tuple[list[int], tuple[str, int]]:
    """The lengths a condition on the length excludes, read by evaluating it at every length up to
    :data:`LENGTHS_CHECKED`: the single lengths below the first of a run of excluded lengths that reaches the
    end (compared by the probe), and the bound that run sets (``(source, longest length)``)."""
    fails = [t for t in range(1, LENGTHS_CHECKED + 1) if not holds(t)]
    start = LENGTHS_CHECKED + 1  # the first length of the excluded run up to the end
    while fails and fails[-1] == start - 1:
        start = fails.pop()
    if start - 1 < 2 or len(fails) > _MAX_EXCLUDED:
        shown = ", ".join(map(str, fails[:_MAX_EXCLUDED])) + (", ..." if len(fails) > _MAX_EXCLUDED else "")
        raise PositionError(
            f"{type(model).__name__}.forward takes another path at {len(fails)} lengths ({shown}): torch.export "
            f"recorded the condition `{text}` for the traced graph, and a cached model serves every length "
            "with the traced path; remove the branch on the length from forward")
    if start <= LENGTHS_CHECKED:
        source = (f"forward's code holds only up to {start - 1} tokens: a length check or a branch on the length "
                  f"such as `if T > n:` (torch.export recorded the condition `{text}`, false from {start} tokens)")
    else:
        source = f"torch.export recorded the condition `{text}`, checked at every length up to {LENGTHS_CHECKED}"
    return fails, (source, start - 1)


def shape_guards(model: nn.Module, ep: Any, tokens: str) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
    """Read the conditions on the input sizes ``torch.export`` recorded while tracing (``ep._guards_code``): what
    must hold for the traced graph to be the model's forward. Returns the single excluded sizes, ``(dim, n)``
    (``attnopt.pipeline.kv`` runs the model at that size and compares), and the bounds on the length the
    conditions set (``max_len`` follows them: ``resolve_max_len``).

    A condition on the length alone (``T <= 64``, ``2 + T <= 66``, ``64 - max(0, 64 - T) != 64``) is evaluated at
    every length up to :data:`LENGTHS_CHECKED`: the run of lengths it excludes up to the end sets a bound, and up
    to ``_MAX_EXCLUDED`` single lengths below it are compared. A condition ``B != n`` on the batch is compared at
    ``n``; tokens and a captured mask of equal sizes are what the capture passes. Any other condition raises
    :class:`PositionError`.

    A cached step runs the graph with other sizes than the capture (one new token, any batch), so a Python
    branch on the batch size or the length (``if T % 2 == 0:``) would be served by the branch traced. Branches
    that only differ at a size of 1 (``if B > 1:``) leave no condition: export assumes sizes of at least 2;
    those are what ``pipeline.kv``'s probe at batch 1 and length 1 compares.
    """
    guards = getattr(ep, "_guards_code", None)
    excluded: list[tuple[int, int]] = []
    bounds: list[tuple[str, int]] = []
    for g in guards or ():
        text = _unwrap(str(g).strip())
        if _SAME.match(text):
            continue  # a mask captured with the tokens' shape (forward_kwargs)
        holds = _length_condition(text, tokens)
        if holds is not None:
            lengths, bound = _length_bound(model, text, holds)
            excluded.extend((1, n) for n in lengths)
            bounds.append(bound)
            continue
        m = _BOUND.match(text)
        if m and m.group(1) in (tokens, "attention_mask") and m.group(2) == "0" and m.group(3) == "!=":
            excluded.append((0, int(m.group(4))))  # the mask: the tokens' shape
            continue
        raise PositionError(
            f"{type(model).__name__}.forward takes a path that depends on the input's size: torch.export recorded "
            f"the condition `{text}` for the traced graph. A cached step runs the graph for one new token (and "
            "other batch sizes) while the model as written sees the whole sequence, so the path traced at capture "
            "would not be the model's on every step; remove the branch on the batch size or length from forward")
    return excluded, bounds


def written_state(graph: fx.Graph) -> list[str]:
    """The attributes (buffers, parameters) ``graph`` writes in place, directly or through ATen views of them
    (``aten.add_(buf, 1)``, ``aten.copy_(buf, new)``, ``aten.slice`` then ``index_put_``)."""
    found = []
    for attr in (n for n in graph.nodes if n.op == "get_attr"):
        todo, seen = [attr], {attr}
        while todo:
            node = todo.pop()
            for user in node.users:
                if writes(user, node):
                    found.append(str(attr.target))
                    todo = []
                    break
                if user not in seen and _is_view(user):
                    seen.add(user)
                    todo.append(user)
    return found


def _is_view(node: fx.Node) -> bool:
    """An ATen op whose result may alias its input and that writes nothing: its schema says so, or it is an op of
    one tensor (or ``type_as``/``reshape_as``) whose schema promises nothing (``einsum("ij->ij", x)``,
    ``_unsafe_view``, ``contiguous``: each may return its input or a view of it)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable:
        return False
    if any(r.alias_info is not None for r in schema.returns):
        return True
    if returns_fresh(target):
        return False
    tensors = [n for n in node.all_input_nodes if isinstance(meta_value(n), torch.Tensor)]
    # ``x.type_as(y)``, ``x.reshape_as(y)``: x itself when nothing changes
    return len(tensors) == 1 or target.overloadpacket in (aten.type_as, aten.reshape_as)


def _mask_of_ones(model: nn.Module, graph: fx.Graph, placeholders: list[fx.Node]) -> None:
    """Replace the ``attention_mask`` input by ``ones`` of the tokens' (symbolic) shape, built in the graph."""
    tokens = placeholders[0]
    mask = next((n for n in placeholders[1:] if n.name == "attention_mask"), None)
    val, shape = (None, None) if mask is None else (meta_value(mask), shape_of(tokens))
    if not isinstance(val, torch.Tensor) or shape is None or tuple(val.shape) != tuple(shape):
        raise PositionError(f"{type(model).__name__}.forward's attention_mask was not captured with the shape of "
                            f"the token ids ({list(shape or [])}); attnopt passes it a (batch, length) mask of ones")
    with graph.inserting_before(placeholders[-1].next):  # after the inputs, in order
        sizes = [graph.call_function(aten.sym_size.int, (tokens, d)) for d in (0, 1)]
        ones = graph.call_function(aten.ones.default, (sizes,), {"dtype": val.dtype, "device": val.device})
    for n, d in zip(sizes, shape):
        n.meta["val"] = d
    ones.meta.update(mask.meta)
    mask.replace_all_uses_with(ones)
    graph.erase_node(mask)
    placeholders.remove(mask)


_FULL_END = 2**63 - 1  # the end ``x[a:]`` records in ATen graphs


def _tidy(gm: fx.GraphModule) -> None:
    """Undo spellings ``torch.export`` adds, so attention matches as it does in dynamo graphs.

    ``aten._assert_tensor_metadata`` (a dtype check after ``.float()``) is dropped; ``a.type_as(b)`` and
    ``a.float()`` (``aten.to.dtype``) become ``aten._to_copy(a, dtype=...)``; ``x[:, :]`` (a slice from 0 to
    the end) and inactive dropout (``aten.dropout(x, p, train=False)`` or ``p == 0``) become ``x``; a number
    made a tensor in forward (``torch.tensor(finfo.min)``: ``lift_fresh_copy`` of a 0-d constant export lifted,
    then maybe ``detach_``, GPT-Neo's fill) becomes ``aten.full([], value)``, as dynamo graphs spell it.
    None of them changes a value; active dropout stays, and the position analysis refuses it.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.lift_fresh_copy.default and isinstance(node.args[0], fx.Node) \
                and node.args[0].op == "get_attr":
            value = _attr(gm, str(node.args[0].target))
            if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
                with graph.inserting_before(node):
                    full = graph.call_function(aten.full.default, ([], value.item()),
                                               {"dtype": value.dtype, "device": value.device})
                full.meta.update(node.meta)
                for user in list(node.users):  # ``torch.tensor(x)`` is detached already: ``detach_`` changes nothing
                    if user.target in (aten.detach_.default, aten.detach.default):
                        user.replace_all_uses_with(full)
                        graph.erase_node(user)
                node.replace_all_uses_with(full)
                graph.erase_node(node)
        elif node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
        elif node.target in (aten.type_as.default, aten.to.dtype):
            with graph.inserting_before(node):
                cast = graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": meta_value(node).dtype})
            cast.meta.update(node.meta)
            node.replace_all_uses_with(cast)
            graph.erase_node(node)
        elif node.target is aten.slice.Tensor and tuple(node.args[2:]) in ((0, _FULL_END), (None, _FULL_END),
                                                                          (0, _FULL_END, 1), (None, _FULL_END, 1)) \
                or node.target is aten.dropout.default and (node.args[1] == 0 or node.args[2] is False):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def config_max(model: nn.Module) -> int | None:
    config = getattr(model, "config", getattr(model, "cfg", None))
    # a composite config (Gemma 3's) holds the text model's sizes in its text config
    try:  # (``get_text_config`` raises for a config with several candidate sub-configs)
        text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    except Exception:  # noqa: BLE001 - no single text config: the top-level one only
        text = None
    for c in (config, text):
        for name in _CONFIG_MAX:
            value = getattr(c, name, None) if c is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def resolve_max_len(requested: int | None, declared: int | None, plan: PositionPlan, ep: Any,
                     tokens: fx.Node) -> tuple[int, str]:
    """The cache length: requested, else declared by the config, else the tightest bound the graph shows."""
    hard = list(plan.bounds)
    seq = plan.seq
    vr = ep.range_constraints.get(seq)
    if vr is not None:
        if isinstance(vr.upper, (int, sympy.Integer)):
            hard.append((f"forward's code holds only up to {int(vr.upper)} tokens: a length check or a branch on "
                         "the length such as `if T > n:`, as torch.export traced it", int(vr.upper)))
    tightest = min(hard, key=lambda b: b[1], default=None)
    if requested is not None:
        if tightest is not None and requested > tightest[1]:
            raise ValueError(f"max_len={requested} exceeds what the model can index: {tightest[1]} positions "
                             f"({tightest[0]})")
        return requested, "requested"
    if declared is not None:
        if tightest is not None and declared > tightest[1]:
            return tightest[1], tightest[0]
        return declared, "the model's config"
    if tightest is not None:
        return tightest[1], tightest[0]
    raise NoMaxLen("could not find the model's maximum number of positions (no config.block_size / "
                   "max_position_embeddings, position table or length check: ALiBi's BLOOM has none); pass max_len= "
                   "(the longest prompt plus the tokens to generate, or more)")


class NoMaxLen(ValueError):
    """The model names no maximum number of positions, and none was given: the caches cannot be sized."""


def cache_bytes_per_token(site_node: fx.Node, tokens: fx.Node) -> int | None:
    """K and V bytes (and a key bias's, ALiBi's) per position of one sequence at one site, read from the symbolic
    shapes of its inputs."""
    shape = shape_of(tokens)
    assert shape is not None
    per_seq = shape[0] * shape[1]
    total = 0
    for x in site_node.args[1:3]:
        val = meta_value(x)
        if not isinstance(val, torch.Tensor):
            return None
        count = sympy.simplify(sympy.sympify(val.numel()) / sympy.sympify(per_seq))
        if not count.is_Integer:
            return None
        total += int(count) * val.element_size()
    bias, q = meta_value(site_node.kwargs.get("key_bias")), meta_value(site_node.args[0])
    if isinstance(bias, torch.Tensor) and isinstance(q, torch.Tensor):  # a term per key, kept for q's heads
        count = sympy.simplify(sympy.sympify(q.numel()) / sympy.sympify(per_seq * q.shape[-1]))
        if not count.is_Integer:
            return None
        total += int(count) * bias.element_size()
    return total


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a forward's result: a tensor, ``(logits, ...)``, or ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model returned {type(out).__name__}; expected logits: a tensor, a tuple whose first "
                    "item is the logits, or an object with .logits")


def _writers(node: fx.Node, depth: int = 8) -> list[fx.Node]:
    """The nodes that write ``node``'s memory in place, directly or through a view or alias of it (``out=``
    included): a value read through ``node`` depends on what they write too."""
    found: list[fx.Node] = []
    todo, seen = [(node, depth)], set()
    while todo:
        n, left = todo.pop()
        if n in seen or left < 0:
            continue
        seen.add(n)
        for user in n.users:
            if writes(user, n):
                found.append(user)
            if may_alias(user, n):
                todo.append((user, left - 1))
    return found


def mask_check(gm: fx.GraphModule, m: Match, tokens: fx.Node, upto: int = 8, probe: int = 64) -> MaskCheck | str:
    """The check for ``m``'s mask terms (all of them together), or why they cannot be used.

    The mask is evaluated at lengths ``1..upto`` and at ``probe``: at ``probe`` it must keep a causal band
    (``i - w < j <= i``; ``w`` is then the check's window, a Mistral-style sliding window, if narrower than
    ``probe``), and at every length the same pattern. A window wider than ``probe`` is seen only at run time,
    where the check refuses the first length whose mask is not causal.
    """
    nodes, kinds = [], []
    for term in m.mask.terms:
        if getattr(term, "binary", False):
            return "its mask is a 0/1 factor"
        nodes.append(term.mask if isinstance(term, Add) else term.cond)
        kinds.append((isinstance(term, Add), getattr(term, "keep_when_true", False)))
    pending, seen = list(nodes), set()
    while pending:
        n = pending.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is tokens:
            return "its mask depends on the token values"
        if n.op == "call_function" and n.target is aten.sym_size.int:
            continue  # only the tokens' sizes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in n.target.tags:
            return "its mask is random"
        pending.extend(n.all_input_nodes)
        pending.extend(x for w in _writers(n) for x in w.all_input_nodes)  # what is written into it, or its views
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, env)
    graph.output(tuple(env[n] for n in nodes))
    graph.eliminate_dead_code()
    where = " ".join(x for x in (m.record.module_path, m.record.source) if x)
    check = MaskCheck(fx.GraphModule(gm, graph), kinds, m.record.name, where)
    device = tokens.meta["val"].device
    check.probe = probe
    lengths = sorted({*range(1, upto + 1), probe})
    try:
        check.window = check.find_window(probe, device)
    except Exception as e:  # noqa: BLE001 - a mask attnopt cannot evaluate is a mask it cannot trust
        return f"its mask could not be evaluated at length {probe} ({type(e).__name__}: {e})"
    for length in lengths:  # refuse masks that are plainly not causal now, not at the first call
        try:
            if not check.holds(2, length, device):
                shape = "causal" if check.window is None else f"a causal window of {check.window} keys"
                return f"its mask is not {shape} at length {length}"
        except Exception as e:  # noqa: BLE001 - a mask attnopt cannot evaluate is a mask it cannot trust
            return f"its mask could not be evaluated at length {length} ({type(e).__name__}: {e})"
    return check


#: ``slice(x, d, start)`` to the end, as export records it (``end`` omitted or the largest int64).
_FULL_SLICE = sys.maxsize


def relative_key_term(gm: fx.GraphModule, node: fx.Node, tokens: fx.Node, declared: int | None) -> fx.Node | None:
    """A term per key equal to ``node`` up to a constant per softmax row, as a new node ``slope * arange(T)``
    (unwired), when ``node`` reads a constant table from its end (MPT's ALiBi); None otherwise.

    MPT builds ``table = slope * arange(1 - S, 1)`` (``(H, 1, S)``, ``S = max_seq_len``) in forward and adds
    ``table[:, max(0, 1 - T):, max(0, S - T):]`` to the scores: key ``j`` gets ``slope * (j - T + 1)``, relative to
    the last key, so its value changes with the length and cannot be kept with the key. It is ``slope * j`` plus
    ``-slope * (T - 1)``, the same for every key of a row, which softmax along the keys ignores: the cache keeps
    ``slope * j``. The caller uses the new term only as a key term of the scores (a ``key_bias``, never with a
    score modifier). Read here:

    * ``node`` slices the table's last axis by ``S - T`` to its end for every ``1 <= T <= S`` (``Max(0, S - T)``
      included), where ``S`` is at least the model's declared maximum length, so the cache never serves more;
    * slices of size-1 axes that keep them whole for every ``T >= 1`` (``max(0, 1 - T):``) are looked through;
    * the table is computed in forward from numbers alone (no input, parameter, buffer or size, nothing written in
      place) and every row of it is affine within 4 units of rounding of that row's largest entry, its slope
      taken in float64 from the ends (a call may read the whole table: ``max_len`` may exceed the declared
      length up to ``S``). ``slope * j`` is
      then what the model adds up to that constant and to the table's own rounding.

    The new term is float64 (float32 on MPS, which has none), so ``slope * j`` loses nothing at long lengths;
    the cache adds it less its largest value per row, in the scores' dtype
    (``KVCacheAttention.relative_key_bias``), which for a positive slope is ``slope * (j - L + 1)`` over the
    ``L`` keys, as written.
    """
    if node.op != "call_function" or node.target is not aten.slice.Tensor or declared is None:
        return None
    seq = meta_value(tokens).shape[1] if isinstance(meta_value(tokens), torch.Tensor) else None
    val = meta_value(node)
    if not isinstance(seq, torch.SymInt) or not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    t = seq.node.expr
    table, dim, start, end, step = _slice_args(node)
    tv = meta_value(table) if isinstance(table, fx.Node) else None
    if not isinstance(tv, torch.Tensor) or tv.dim() < 2 or dim % tv.dim() != tv.dim() - 1 or step != 1:
        return None
    while isinstance(table, fx.Node) and table.op == "call_function" and table.target is aten.slice.Tensor:
        inner, d, s0, e0, st = _slice_args(table)  # a size-1 axis kept whole at every length
        iv = meta_value(inner) if isinstance(inner, fx.Node) else None
        if not isinstance(iv, torch.Tensor) or d % iv.dim() == iv.dim() - 1 or iv.shape[d] != 1 or st != 1 \
                or e0 not in (None, _FULL_SLICE) or not _for_every_length(s0, t, lambda e, u: e, 0):
            return None
        table = inner
    tv = meta_value(table)
    shape = tuple(tv.shape) if isinstance(tv, torch.Tensor) else ()
    if not shape or not all(isinstance(n, int) for n in shape) or shape[-2] != 1 or shape[-1] < 2:
        return None
    size = shape[-1]
    if declared > size or end not in (None, _FULL_SLICE, size) \
            or not _for_every_length(start, t, lambda e, u: e - u, 0, upto=size):
        return None
    value = _constant_value(gm, table)
    if value is None or not value.is_floating_point():
        return None
    # the whole table: a ``max_len`` above the declared length reads further back (up to ``size``); row by row,
    # against the row's own entries, so a steep row's size does not excuse another row's bend
    v = value.detach().cpu().double()  # (checked on the CPU: some devices have no float64)
    slope = (v[..., -1:] - v[..., :1]) / (size - 1)
    fit = v[..., :1] + slope * torch.arange(size, dtype=torch.float64, device=v.device)
    tolerance = 4 * torch.finfo(value.dtype).eps * v.abs().amax(-1, keepdim=True) + torch.finfo(torch.float64).tiny
    if not bool(torch.isfinite(v).all()) or not bool(((v - fit).abs() <= tolerance).all()):
        return None
    # the cache serves at most ``size`` positions: a longer call would read before the table's start
    where = node.meta.get("stack_trace", "").strip().splitlines()[-1:] or [node.name]
    gm.meta.setdefault("length_bounds", []).append((f"the table read from its end at {where[0].strip()}", size))
    name = f"_attnopt_key_slope{sum(1 for b in gm._buffers if b.startswith('_attnopt_key_slope'))}"
    # float64: ``slope * j`` keeps its precision at any length (float32 where the device has no float64: MPS)
    wide = torch.float32 if value.device.type == "mps" else torch.float64
    gm.register_buffer(name, slope.to(device=value.device, dtype=wide))
    graph, fake = gm.graph, tv.fake_mode
    with graph.inserting_before(node):
        a = graph.get_attr(name)
        n = graph.call_function(aten.sym_size.int, (tokens, 1))
        j = graph.call_function(aten.arange.default, (n,), {"dtype": wide, "device": value.device})
        term = graph.call_function(aten.mul.Tensor, (a, j))
    with fake:
        a.meta["val"] = fake.from_tensor(getattr(gm, name))
        n.meta["val"] = seq
        j.meta["val"] = torch.arange(seq, dtype=wide, device=value.device)
        term.meta["val"] = a.meta["val"] * j.meta["val"]
    for new in (a, n, j, term):
        new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
    return term


def _slice_args(node: fx.Node) -> tuple[Any, int, Any, Any, Any]:
    """``aten.slice``'s ``(input, dim, start, end, step)``, defaults filled in."""
    kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    assert kw is not None, "aten.slice.Tensor has a schema"
    return tuple(kw.kwargs[k] for k in ("input", "dim", "start", "end", "step"))  # type: ignore[return-value]


def _for_every_length(x: Any, t: sympy.Expr, want: Callable[[Any, Any], Any], equal: Any, upto: int | None = None
                      ) -> bool:
    """``want(x, u) == equal`` for every length ``T >= 1`` (``u = T - 1``), or every ``1 <= T <= upto``
    (``u = upto - T``), with ``x`` a number or a node whose value is an expression of the length ``t``."""
    e = meta_value(x) if isinstance(x, fx.Node) else x
    if isinstance(e, torch.SymInt):
        e = e.node.expr
    if e is None:
        e = 0
    if not isinstance(e, (int, sympy.Basic)) or isinstance(e, bool):
        return False
    u = sympy.Symbol("attnopt_u", integer=True, nonnegative=True)
    at = sympy.sympify(e).subs(t, u + 1 if upto is None else upto - u)
    return bool(sympy.simplify(want(at, u) - equal) == 0)


def _constant_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """``node``'s value when it is computed from numbers alone: no input, parameter, buffer or size among what it
    is computed from, nothing there written in place or random; None otherwise."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable \
                or _writers(n) or any(isinstance(a, (torch.SymInt, torch.SymFloat)) for a in pytree.tree_leaves(
                    (n.args, n.kwargs))):
            return None
        todo.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n in seen:
            args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None
