"""``attnopt profile``: where a model's time and memory go, before and after attnopt, over a sweep.

    $ attnopt profile nanogpt --batch-sizes 1,8 --seq-lens 128,512,2048 --phase both --out prof/
    $ attnopt profile my_models.py:build --variants eager,auto,math --trace --out prof/
    $ attnopt profile nanogpt --batch-sizes 1,4,16 --phase prefill,train --memory-timeline --out prof/
    >>> report = attnopt.profile("nanogpt", seq_lens=(128, 512), out="prof")   # the same data as a dict

Design. A SPEC (``attnopt.profiling.spec``) gives the model and ``make_inputs(batch_size,
seq_len)``. The model is moved to the device and dtype and put in eval mode; every measurement
runs under ``no_grad`` (inference), except the ``train`` phase's (train mode, forward +
backward). Variants: ``eager`` is the model as written; any other name is
``attnopt.optimize(model, variant=name)`` (``auto``, ``sdpa`` or a registered candidate).
For every point (batch size x sequence length x phase), in order:

1. warm up each variant twice (dynamo captures here); a variant that raises is recorded with
   ``status`` ``oom`` or ``error`` and the error text, and the sweep goes on;
2. time the variants in alternation, median of ``repeats`` (``attnopt.profiling.measure``);
3. profile each variant a few times for the time inside its attention sites, where the time goes
   (``attnopt.profiling.breakdown``: ops and modules by self and total time) and, on CUDA, the
   idle gaps between kernels; the eager model's sites are timed on dynamo's capture of it with
   a range around each site and each module (eager attention is not a separate call);
4. profile one call for the peak tensor memory, the op whose allocation reached it and the live
   memory over the call (drawn with ``memory_timeline``);
5. count the attention FLOPs once (from the captured sites' q and v shapes, without the entries
   a proven causal mask removes) and compare the achieved FLOP/s with the matmul rate measured
   once at the start (the roofline ratio).

Phases: ``prefill`` is one forward over T tokens. ``decode`` (causal LMs whose input is one
``(B, T)`` token tensor) is one new token against a context of T: with
``attnopt.generation.cached(model, variant=<the variant>)`` when it accepts the model (prefill
untimed, then one timed ``step``), otherwise a full forward over T + 1 tokens; the record says which
(``decode_method``) and why (``decode_note``). The eager variant always recomputes: the model
as written has no cache. ``train`` is one training step without the optimizer: forward, a
scalar loss, backward (``backward_s`` apart), gradients freed before each step.

After the sweep, ``attnopt.profiling.sweet_spot`` reads the batch sizes of every (phase, T,
variant): where throughput stops growing, the first that fails, the first over ``memory_budget``.

Outputs under ``--out DIR``: ``report.json`` (``attnopt.profiling.report.REPORT_SCHEMA``,
rewritten after every point), ``report.html`` (``attnopt.profiling.html``: everything on one
page), PNG plots (``attnopt.profiling.plots``, with matplotlib), ``traces/*.json`` chrome traces
(with ``--trace``; on CUDA also the memory timeline), and on the terminal a progress bar, the
table, the breakdown table and a summary in words.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import accepted_variants
from ..env import __version__, parse_bytes
from ..selection.stats import quartiles
from .html import write_html
from .measure import (
    Runner,
    SiteCounter,
    Timeline,
    bracket_sites,
    is_oom,
    make_runner,
    make_train_runner,
    matmul_rate,
    profile_memory,
    profile_ranges,
    sync,
    time_runners,
)
from .plots import memory_timeline_plot, plot
from .report import SCHEMA_VERSION, finite, summarize, write_json
from .spec import Target, resolve
from .sweet_spot import batch_sweeps

__all__ = ["check_options", "phases_of", "profile"]

#: single phases, and the names of several: both = prefill + decode, all = the three
PHASES = ("prefill", "decode", "train", "both", "all")
_GROUPS = {"both": ("prefill", "decode"), "all": ("prefill", "decode", "train")}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
PROFILED_CALLS = 3


def phases_of(phase: str) -> list[str]:
    """The phases a ``--phase`` value names, in sweep order: ``"prefill,train"``, ``"both"``, ``"all"``, ..."""
    names: list[str] = []
    for part in (p.strip() for p in str(phase).split(",")):
        if part not in PHASES:
            raise ValueError(f"--phase must be one of {', '.join(PHASES)} or several separated by commas "
                             f"(e.g. prefill,train), got {phase!r}")
        names += _GROUPS.get(part, (part,))
    return [p for p in ("prefill", "decode", "train") if p in names]


def check_options(*, batch_sizes: Sequence[int], seq_lens: Sequence[int], phase: str, variants: Sequence[str],
                  dtype: str, device: str, repeats: int, matmul_size: int | None = None,
                  threads: int | None = None, sweet_spot_threshold: float = 0.1) -> str | None:
    """What is wrong with these options (a message naming the accepted values), or None."""
    for name, values in (("batch-sizes", batch_sizes), ("seq-lens", seq_lens)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            return f"--{name} must be positive integers separated by commas (e.g. 1,8), got {list(values)}"
    try:
        phases_of(phase)
    except ValueError as e:
        return str(e)
    accepted = accepted_variants()
    bad = [v for v in variants if v not in accepted]
    if not variants or bad:
        return f"unknown variant(s) {bad or '(none given)'} in --variants; accepted: {', '.join(accepted)}"
    if len(set(variants)) != len(variants):
        return f"--variants lists a variant twice: {list(variants)}"
    if dtype not in DTYPES:
        return f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    if dev.type not in ("cpu", "cuda"):
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available on this machine; use --device cpu"
    if repeats < 1:
        return f"--repeats must be >= 1, got {repeats}"
    if matmul_size is not None and matmul_size < 1:
        return f"--matmul-size must be >= 1, got {matmul_size}"
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        return f"--threads must be >= 1, got {threads}"
    if not sweet_spot_threshold > 0:
        return f"--sweet-spot-threshold must be > 0 (a fraction: 0.1 is 10% per doubling), got {sweet_spot_threshold}"
    return None


def profile(spec: str, *, batch_sizes: Iterable[int] = (1,), seq_lens: Iterable[int] = (128, 512),
            phase: str = "prefill", variants: Iterable[str] = ("eager", "auto"), dtype: str = "float32",
            device: str = "cpu", repeats: int = 10, trace: bool = False, out: str | os.PathLike[str] | None = None,
            progress: bool = True, matmul_size: int | None = None, seed: int = 0,
            threads: int | None = None, kv_budget: int | str | None = None,
            memory_budget: int | str | None = None, memory_timeline: bool = False,
            sweet_spot_threshold: float = 0.1) -> dict[str, Any]:
    """Profile ``spec`` over the sweep and return the report (the content of ``report.json``).

    Args:
        spec: a built-in example (``"nanogpt"``, ``"bert"``), ``"package.module:factory"`` or
            ``"path/to/file.py:factory"``; ``factory()`` returns ``(model, make_inputs)``.
        batch_sizes, seq_lens: the sweep (every combination).
        phase: ``"prefill"``, ``"decode"``, ``"train"`` (forward + backward), ``"both"`` (prefill and
            decode), ``"all"`` or several separated by commas (``"prefill,train"``).
        variants: ``"eager"`` (as written), ``"auto"``, ``"sdpa"`` or any ``attnopt.candidate_names()``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (parameters and floating inputs).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        repeats: timed calls per variant and point (medians are reported).
        trace: write a chrome trace per point and variant (needs ``out``).
        out: folder for ``report.json``, plots and traces; None writes nothing.
        progress: show a progress bar over the sweep.
        matmul_size: side of the square matmul that measures the device's rate (default 1024 on
            CPU, 8192 on CUDA).
        seed: seed for weights and inputs.
        threads: CPU threads torch uses during the run (``torch.set_num_threads``; restored after).
            On a machine other processes share, 1 thread keeps timings steadier.
        kv_budget: bytes (or ``"8GiB"``) of KV cache to plan for: decode points served by a cache then say
            how many sequences of their length fit in it.
        memory_budget: bytes (or ``"8GiB"``) one call may use (its peak tensor memory, plus the KV cache
            when decoding from one): the batch-size summary names the first batch size above it.
        memory_timeline: write ``memory_<phase>_B<b>_T<t>.png`` per point (live tensor memory over
            one call, attention sites marked; needs ``out``).
        sweet_spot_threshold: throughput growth per doubling of the batch size below which it has
            stopped growing (default 0.1: 10%; see :mod:`attnopt.profiling.sweet_spot`).
    """
    kv_budget = parse_bytes(kv_budget, "kv_budget")
    memory_budget = parse_bytes(memory_budget, "memory_budget")
    batch_sizes, seq_lens, variants = list(batch_sizes), list(seq_lens), list(variants)
    problem = check_options(batch_sizes=batch_sizes, seq_lens=seq_lens, phase=phase, variants=variants,
                            dtype=dtype, device=device, repeats=repeats, matmul_size=matmul_size, threads=threads,
                            sweet_spot_threshold=sweet_spot_threshold)
    if problem:
        raise ValueError(problem)
    if trace and out is None:
        raise ValueError("trace=True writes chrome traces under out; pass out=<folder>")
    if memory_timeline and out is None:
        raise ValueError("memory_timeline=True writes PNGs under out; pass out=<folder>")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # dynamo's recompile limit counts the captures of the model's forward across every variant, the eager
    # capture and each (shape, grad mode, train/eval) they run in; at its default (8) a sweep with a few variants
    # and phases would fall back to running the later points unoptimized and unmeasured
    limit = max(torch._dynamo.config.recompile_limit, 16 * (len(variants) + 1) * len(phases_of(phase)))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            return _sweep(spec, batch_sizes, seq_lens, phase, variants, dtype, device, repeats, trace, out, progress,
                          matmul_size, seed, kv_budget, memory_budget, memory_timeline, sweet_spot_threshold)
    finally:
        torch.set_num_threads(previous_threads)


def _sweep(spec: str, batch_sizes: list[int], seq_lens: list[int], phase: str, variants: list[str], dtype: str,
           device: str, repeats: int, trace: bool, out: str | os.PathLike[str] | None, progress: bool,
           matmul_size: int | None, seed: int, kv_budget: int | None = None, memory_budget: int | None = None,
           memory_timeline: bool = False, sweet_spot_threshold: float = 0.1) -> dict[str, Any]:
    phases = phases_of(phase)
    dev, dt = torch.device(device), DTYPES[dtype]
    out_dir = Path(out) if out is not None else None

    torch.manual_seed(seed)
    target = resolve(spec, max_seq_len=max(seq_lens) + ("decode" in phases))
    model = target.model.to(device=dev, dtype=dt).eval()
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "command": "attnopt profile", "spec": spec,
        "description": target.description,
        "options": {"batch_sizes": batch_sizes, "seq_lens": seq_lens, "phase": phase, "variants": variants,
                    "dtype": str(dt).replace("torch.", ""), "device": str(dev), "repeats": repeats, "trace": trace,
                    "seed": seed, "kv_budget": kv_budget, "memory_budget": memory_budget,
                    "memory_timeline": memory_timeline, "sweet_spot_threshold": sweet_spot_threshold},
        "environment": _environment(dev, dt, matmul_size or (8192 if dev.type == "cuda" else 1024)),
        "complete": False, "records": [], "batch_sweeps": [], "summary": [], "plots": [], "html": None,
    }
    session = _Session(target, model, variants, dev, dt, repeats, out_dir if trace else None, seed,
                       report["environment"]["matmul"]["flops_per_s"], max(seq_lens) + 1, memory_timeline)
    timelines: list[str] = []
    points = [(ph, b, t) for ph in phases for b in batch_sizes for t in seq_lens]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(points, desc="profile", unit="point")
    try:
        for ph, b, t in bar if bar is not None else points:
            if bar is not None:
                bar.set_postfix_str(f"{ph} B={b} T={t}")
            records = session.point(ph, b, t)
            if memory_timeline and out_dir is not None and session.timelines:
                path = memory_timeline_plot(session.timelines, out_dir / f"memory_{ph}_B{b}_T{t}.png",
                                            f"{ph}, B={b}, T={t}")
                if path is not None:
                    timelines.append(path)
                    for rec in records:
                        if rec["variant"] in session.timelines:
                            rec["memory_plot"] = path
            report["records"].extend(records)
            if out_dir is not None:
                write_json(out_dir / "report.json", report)
    finally:
        if bar is not None:
            bar.close()
    report["batch_sweeps"] = batch_sweeps(report["records"], sweet_spot_threshold, memory_budget)
    report["summary"] = summarize(report["records"], kv_budget, report["batch_sweeps"], memory_budget)
    if out_dir is not None:
        report["plots"], why = plot(report["records"], out_dir, report["batch_sweeps"], kv_budget)
        report["plots"] += timelines
        if why:
            print(f"attnopt profile: {why}", file=sys.stderr)
    report["complete"] = True
    if out_dir is not None:
        report["html"] = str(out_dir / "report.html")
        write_html(out_dir / "report.html", report)
        write_json(out_dir / "report.json", report)
    return report


def _environment(dev: torch.device, dt: torch.dtype, matmul_size: int) -> dict[str, Any]:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"torch": torch.__version__, "attnopt": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(dev), "device_name": name,
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "load_average": load,
            "generation": _generation()[1] or "attnopt.generation.cached available",
            "matmul": matmul_rate(dev, dt, matmul_size)}


def _generation() -> tuple[Callable[..., Any] | None, str | None]:
    """``attnopt.generation.cached`` (the tests put a fake one here), or None and why it cannot be used."""
    from ..pipeline.kv import cached

    return cached, None


def _iqr(samples: list[float]) -> list[float] | None:
    """``[q1, q3]`` of the timed calls, or None with fewer than two."""
    if len(samples) < 2:
        return None
    q1, _, q3 = quartiles(samples)
    return [q1, q3]


def _record(phase: str, b: int, t: int, variant: str, **fields: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "batch_size": b, "seq_len": t, "phase": phase, "variant": variant, "status": "ok", "error": None,
        "decode_method": None, "decode_note": None, "forward_s": None, "profiled_forward_s": None, "attention_s": None,
        "attention_share": None, "attention_method": None, "attention_note": None, "sites": {},
        "peak_bytes": None, "peak_op": None, "attention_flops": None, "attention_flops_per_s": None,
        "roofline_ratio": None, "idle_gap_s": None, "idle_gap_share": None, "idle_gap_note": None,
        "speedup_vs_eager": None, "peak_ratio_vs_eager": None, "trace": None, "memory_timeline": None,
        "forward_iqr_s": None, "kv_bytes_per_token": None, "kv_context_bytes": None,
        "backward_s": None, "breakdown": None, "memory_plot": None, "fallbacks": {},
    }
    rec.update(fields)
    return rec


def _failed(rec: dict[str, Any], e: BaseException) -> None:
    rec["status"] = "oom" if is_oom(e) else "error"
    rec["error"] = f"{type(e).__name__}: {e}".strip()  # in full: the summary shortens it


class _Session:
    """The state one sweep shares across points: the variants' models and the eager site capture."""

    def __init__(self, target: Target, model: torch.nn.Module, variants: list[str], dev: torch.device,
                 dt: torch.dtype, repeats: int, trace_dir: Path | None, seed: int, matmul_flops: float,
                 decode_len: int = 0, memory_timeline: bool = False):
        from .. import api  # a module attribute, so that tests can replace api.optimize

        self.target, self.model, self.dev, self.dt = target, model, dev, dt
        self.repeats, self.trace_dir, self.seed, self.matmul_flops = repeats, trace_dir, seed, matmul_flops
        self.models = {v: model if v == "eager" else api.optimize(model, variant=v) for v in variants}
        self.bracketed, self.counter = bracket_sites(model)
        self.decode_len = decode_len  # the cached models hold the longest context of the sweep plus one token
        self.cached: dict[str, Any] = {}  # variant -> CachedLM, built (captured) once per sweep, or why not
        self.memory_timeline = memory_timeline
        self.timelines: dict[str, Timeline] = {}  # variant -> live memory over one call, at the last point
        self.fallbacks_seen: dict[str, dict[str, dict[str, int]]] = {}  # variant -> the counts after the last point

    # -- one point ---------------------------------------------------------------------------------------------
    def point(self, phase: str, b: int, t: int) -> list[dict[str, Any]]:
        """The records of every variant at one point; a training point runs the model in train mode."""
        self.timelines = {}
        if phase != "train":
            return self._point(phase, b, t)
        self.model.train()
        try:
            return self._point(phase, b, t)
        finally:
            self.model.eval()
            for p in self.model.parameters():
                p.grad = None

    def _point(self, phase: str, b: int, t: int) -> list[dict[str, Any]]:
        torch.manual_seed(self.seed)
        records = {v: _record(phase, b, t, v) for v in self.models}
        try:
            runners, eager_profiled, call = self._runners(phase, b, t, records)
        except _Skip as s:
            for rec in records.values():
                rec.update(status="skipped", error=str(s))
            return list(records.values())
        except Exception as e:  # noqa: BLE001 - inputs could not be made: every variant fails alike
            for rec in records.values():
                _failed(rec, e)
            return list(records.values())
        self._warm(runners, records)
        if phase == "train" and "eager" in runners:
            # the eager capture's sites are profiled with gradients on: capture that graph before profiling
            self._warm({"eager": eager_profiled}, records)
            runners = {v: r for v, r in runners.items() if records[v]["status"] == "ok"}
        self._time(runners, records)
        flops, dense, sites_where = self._count_flops(*call)
        if phase == "train" and flops is not None:
            flops *= 3  # the backward's four products (dV, dP, dQ, dK) on the same shapes: twice the forward's two
        for v, runner in runners.items():
            rec = records[v]
            try:
                # a cached step attends one query row to all T+1 keys: 1/(T+1) of the dense full recompute
                step = None if dense is None else dense / (t + 1)
                self._inspect(v, rec, eager_profiled if v == "eager" else runner, sites_where,
                              step if rec["decode_method"] == "kv_cache" else flops)
                # module paths need the model's own call; compiled variants run one graph instead
                as_written = v == "eager" and rec["decode_method"] != "kv_cache"
                mem = profile_memory(runner, self.dev, model=self.model if as_written else None,
                                     wrappers=frozenset({"OptimizedModule", "GraphModule", type(self.model).__name__}),
                                     site_modules=frozenset(w.split(" ")[0] for w in sites_where.values()))
                rec["peak_bytes"] = mem.peak_bytes
                rec["peak_op"] = {"op": mem.op, "shapes": mem.shapes, "alloc_bytes": mem.alloc_bytes,
                                  "module": mem.module, "site": mem.site, "backward": mem.backward}
                if self.memory_timeline and mem.timeline is not None:
                    self.timelines[v] = mem.timeline
                if self.trace_dir is not None and self.dev.type == "cuda":
                    rec["memory_timeline"] = _memory_timeline(mem.profiler, self.trace_dir / "traces" /
                                                              f"{phase}_B{b}_T{t}_{v}_memory", self.dev)
            except Exception as e:  # noqa: BLE001 - record it, keep sweeping
                _failed(rec, e)
                self._release()
        for v, rec in records.items():
            if v != "eager" and rec["decode_method"] != "kv_cache":
                rec["fallbacks"] = self._new_fallbacks(v)
        eager = records.get("eager")
        for rec in records.values():
            if eager is not None and eager["status"] == "ok" and rec["status"] == "ok" and rec is not eager:
                rec["speedup_vs_eager"] = finite(eager["forward_s"] / rec["forward_s"])
                if eager["peak_bytes"] and rec["peak_bytes"]:
                    rec["peak_ratio_vs_eager"] = eager["peak_bytes"] / rec["peak_bytes"]
        return list(records.values())

    def _runners(self, phase: str, b: int, t: int,
                 records: dict[str, dict[str, Any]]) -> tuple[dict[str, Runner], Runner, tuple[Any, ...]]:
        """Runners per variant, the runner whose site ranges time eager, the (args, kwargs) of a full call."""
        if phase == "prefill":
            args, kwargs = self.target.inputs(b, t, dtype=self.dt, device=self.dev)
            runners = {v: make_runner(m, args, kwargs, self.dev) for v, m in self.models.items()}
            return runners, make_runner(self.bracketed, args, kwargs, self.dev), (args, kwargs)
        if phase == "train":
            args, kwargs = self.target.inputs(b, t, dtype=self.dt, device=self.dev)
            params = [p for p in self.model.parameters() if p.requires_grad]
            if not params:
                raise _Skip("training needs trainable parameters; the model has none")
            runners = {v: make_train_runner(m, args, kwargs, self.dev, params) for v, m in self.models.items()}
            return runners, make_train_runner(self.bracketed, args, kwargs, self.dev, params), (args, kwargs)
        if self.target.causal_lm is False:
            raise _Skip(f"decode applies to causal language models; {self.target.spec} is not one")
        args, kwargs = self.target.inputs(b, t + 1, dtype=self.dt, device=self.dev)
        idx = args[0] if len(args) == 1 and not kwargs else None
        if not (isinstance(idx, torch.Tensor) and idx.dim() == 2 and not idx.is_floating_point()):
            raise _Skip("decode needs make_inputs(batch_size, seq_len) to return one (batch, seq_len) tensor of "
                        "token ids")
        runners: dict[str, Runner] = {}
        for v, m in self.models.items():
            rec = records[v]
            runner, note = (None, "the model as written has no KV cache") if v == "eager" else self._cached(v, idx, t)
            if runner is None:
                runner = make_runner(m, (idx,), {}, self.dev)
                rec.update(decode_method="full_recompute", decode_note=f"forward over T+1 tokens: {note}")
            else:
                rec.update(decode_method="kv_cache", decode_note=note)
                per = getattr(self.cached[v], "bytes_per_token", None)  # None: a cache that does not say
                rec.update(kv_bytes_per_token=per,
                           kv_context_bytes=None if per is None else per * idx.size(0) * idx.size(1))
            runners[v] = runner
        return runners, make_runner(self.bracketed, (idx,), {}, self.dev), ((idx,), {})

    def _cached(self, variant: str, idx: torch.Tensor, t: int) -> tuple[Runner | None, str]:
        if variant not in self.cached:
            cached, why = _generation()
            if cached is None:
                self.cached[variant] = why or ""
            else:
                try:
                    self.cached[variant] = cached(self.model, max_len=max(self.decode_len, t + 1), variant=variant)
                except Exception as e:  # noqa: BLE001 - it refuses models it cannot cache exactly
                    self.cached[variant] = f"attnopt.generation.cached refused the model: {type(e).__name__}: {e}"
        c = self.cached[variant]
        if isinstance(c, str):
            return None, c
        context, new = idx[:, :t], idx[:, t:]

        def run() -> Any:
            out = c.step(new)
            sync(self.dev)
            return out

        note = "attnopt.generation.cached: prefill untimed, one step timed"
        return Runner(run, setup=lambda: c.prefill(context)), note

    def _warm(self, runners: dict[str, Runner], records: dict[str, dict[str, Any]]) -> None:
        for v in list(runners):
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # recompiles and fallbacks warn; attnopt.explain() has them
                    runners[v]()
                    runners[v]()
            except Exception as e:  # noqa: BLE001
                _failed(records[v], e)
                del runners[v]
                self._release()

    def _time(self, runners: dict[str, Runner], records: dict[str, dict[str, Any]]) -> None:
        samples: dict[str, list[float]] = {}
        for r in runners.values():
            if r.backward_s is not None:
                r.backward_s.clear()  # the warm-up's
        try:
            for v, s in time_runners(runners, self.repeats, samples).items():
                self._timed(records[v], runners[v], s, samples[v])
            return
        except Exception:  # noqa: BLE001 - find which variant fails by timing them one by one
            self._release()
        for v in list(runners):
            try:
                if runners[v].backward_s is not None:
                    runners[v].backward_s.clear()
                self._timed(records[v], runners[v], time_runners({v: runners[v]}, self.repeats, samples)[v],
                            samples[v])
            except Exception as e:  # noqa: BLE001
                _failed(records[v], e)
                del runners[v]
                self._release()

    def _new_fallbacks(self, variant: str) -> dict[str, dict[str, int]]:
        """Calls of this point that a rewritten site ran as written (or by a replacement), per site and reason.

        The runtime counts them over the model's life in each site record's ``extra["fallbacks"]``
        (``attnopt.explain`` shows them); this is the growth since the variant's last point.
        """
        from ..api import explain

        try:
            records = explain(self.models[variant]).records
        except Exception:  # noqa: BLE001 - a variant without a report has nothing to count
            return {}
        now: dict[str, dict[str, int]] = {}
        for r in records:
            counts = r.extra.get("fallbacks") if isinstance(getattr(r, "extra", None), dict) else None
            if isinstance(counts, dict):
                now[r.name] = {str(k): n for k, n in counts.items() if isinstance(n, int)}
        before = self.fallbacks_seen.get(variant, {})
        self.fallbacks_seen[variant] = now
        grown = {site: {why: n - before.get(site, {}).get(why, 0) for why, n in counts.items()}
                 for site, counts in now.items()}
        return {site: {why: n for why, n in counts.items() if n > 0} for site, counts in grown.items()
                if any(n > 0 for n in counts.values())}

    @staticmethod
    def _timed(rec: dict[str, Any], runner: Runner, seconds: float, samples: list[float]) -> None:
        rec["forward_s"] = seconds
        rec["forward_iqr_s"] = _iqr(samples)
        if runner.backward_s:
            rec["backward_s"] = statistics.median(runner.backward_s)

    def _count_flops(self, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[float | None, float | None, dict[str, str]]:
        """Useful and dense attention FLOPs of one full call, counted on the eager capture; the sites' places."""
        counter: SiteCounter = self.counter
        counter.flops.clear()
        counter.dense_flops.clear()
        counter.counting = True
        try:
            with torch.no_grad():
                self.bracketed(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the eager variant's record carries the error
            return None, None, dict(counter.where)
        finally:
            counter.counting = False
        return (sum(counter.flops.values()) or None), (sum(counter.dense_flops.values()) or None), dict(counter.where)

    def _inspect(self, variant: str, rec: dict[str, Any], runner: Runner, eager_where: dict[str, str],
                 flops: float | None) -> None:
        """Attention time, share, roofline and gaps of one variant from profiled calls."""
        from ..api import explain

        ranges = profile_ranges(runner, self.dev, PROFILED_CALLS)
        rec["breakdown"] = ranges.breakdown
        if rec["phase"] == "train" and ranges.breakdown is not None and ranges.attention_s is not None:
            # a training step: the sites' forward ranges and the backward of the ops inside them (autograd's
            # sequence numbers tie each backward node to its forward op), over the whole step
            ranges.attention_s = ranges.breakdown["attention_s"]
            ranges.forward_s = ranges.breakdown["total_s"]
        where = eager_where if variant == "eager" else _site_places(explain(self.models[variant]))
        rec["sites"] = {n: {"seconds": s, "where": where.get(n, "")} for n, s in ranges.sites_s.items()}
        rec["profiled_forward_s"] = ranges.forward_s
        if ranges.attention_s is None:
            if rec["decode_method"] == "kv_cache":
                rec["attention_note"] = "the cached step runs no attnopt::<site> range"
            else:
                rec["attention_note"] = "no attention site ran in an attnopt::<site> range (none found or rewritten)"
                if variant == "eager" and self.counter.failures:
                    rec["attention_note"] += f"; capturing the sites failed: {'; '.join(self.counter.failures)}"
        else:
            if variant == "eager":
                rec["attention_method"] = "captured_regions"
                rec["attention_note"] = ("ops from each site's score product to its P @ V, timed on dynamo's "
                                         "capture of the model as written")
            else:
                rec["attention_method"] = "site_ranges"
            rec["attention_s"] = ranges.attention_s
            rec["attention_share"] = finite(ranges.attention_s / ranges.forward_s) if ranges.forward_s else None
            if flops is not None and ranges.attention_s > 0:
                rec["attention_flops_per_s"] = flops / ranges.attention_s
                rec["roofline_ratio"] = rec["attention_flops_per_s"] / self.matmul_flops
        if flops is not None:
            rec["attention_flops"] = flops
        if self.dev.type == "cuda":
            rec["idle_gap_s"], rec["idle_gap_share"] = ranges.idle_gap_s, ranges.idle_gap_share
        else:
            rec["idle_gap_note"] = "n/a on CPU"
        if self.trace_dir is not None:
            path = self.trace_dir / "traces" / f"{rec['phase']}_B{rec['batch_size']}_T{rec['seq_len']}_{variant}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            ranges.profiler.export_chrome_trace(str(path))
            rec["trace"] = str(path)

    def _release(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def _site_places(report: Any) -> dict[str, str]:
    """Site name -> "module.path (file:line)" for the sites an optimized model's report says it rewrote."""
    return {r.name: " ".join(x for x in (r.module_path, f"({r.source})" if r.source else "") if x)
            for r in report.records if r.rewritten}


def _memory_timeline(prof: Any, stem: Path, dev: torch.device) -> str | None:
    """torch.profiler's memory timeline of ``prof`` (an HTML plot with matplotlib, else JSON), or None."""
    try:
        import matplotlib  # noqa: F401 - the HTML export draws with it

        path = stem.with_suffix(".html")
    except ImportError:
        path = stem.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if dev.type == "cuda" and dev.index is None:
            # the timeline keeps the allocations whose device equals this one exactly: "cuda" matches none of
            # the "cuda:0" ones the profiler records
            dev = torch.device("cuda", torch.cuda.current_device())
        prof.export_memory_timeline(str(path), device=str(dev))
    except Exception as e:  # noqa: BLE001 - a missing timeline must not fail the measurement
        warnings.warn(f"attnopt profile: memory timeline not written ({type(e).__name__}: {e})", stacklevel=2)
        return None
    return str(path)


class _Skip(Exception):
    """A phase that does not apply to this model; the message says why."""


