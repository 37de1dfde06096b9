"""Tuning results on disk: which candidate was fastest for one site shape on one machine and setup.

The selector times every legal candidate for a (site, shape key) and keeps the result here,
so later runs and other processes skip the timing::

    >>> cache = TuningCache()                                  # $ATTNOPT_CACHE_DIR or the user cache dir
    >>> key = cache.key({"B": 1, "H": 12, "Tq": 1024, "Tk": 1024, "D": 64, "dtype": torch.float32},
    ...                 ["sdpa", "math"], torch.device("cpu"))
    >>> cache.lookup(key)                                      # None: never tuned here
    >>> cache.store(key, TuningEntry("sdpa", {"sdpa": 42.4, "math": 116.3}))
    >>> cache.lookup(key).choice
    'sdpa'

Design:

* **The key is everything the answer depends on**: the environment (attnopt version, torch version,
  device type and name, CUDA capability or CPU model and torch's thread count), the sorted
  candidate set and the shape key. ``key()`` returns it as plain JSON data; its canonical JSON
  (sorted keys, no spaces) is what is hashed and compared.
* **One JSON file per key**, ``<sha256 of the canonical key>.json``, holding ``{"format", "key",
  "entry"}``. A lookup compares the stored key with the requested one, so a foreign file, a hash
  collision or a file written by another attnopt/torch version is a miss, never a wrong answer.
* **Atomic writes**: the file is written under a unique temporary name in the same directory and
  moved into place with ``os.replace``, so a concurrent reader sees the old file or the new one,
  never a partial one; the last writer wins. The directory is created on demand.
* **Failures never break a model**: a corrupt or unreadable file is a miss with a warning naming
  the file (the next ``store`` overwrites it); a directory that cannot be written warns once, and
  the cache keeps working in memory for this process.
* **An in-memory layer** in front of the disk: repeated lookups of a key in one process read the
  disk once. Misses are not remembered, so a result stored by another process is found later.
* ``ATTNOPT_CACHE=0`` (or ``off``/``false``/``no``) turns the disk layer off.
* **Provisional entries** (a choice made without separating the winner from a rival) are stored
  with ``provisional=True``: the selector times their key again where it next meets it. Files of
  format 1 (before the entries carried confidence statistics) are read as provisional.
* :meth:`TuningCache.records` lists every entry in the directory and :meth:`TuningCache.remove`
  forgets one (``attnopt cache list|show|clear|retune`` is built on them).

Timings of candidates that raised or were rejected are ``inf``; in the file they are written as
``null`` so that every file is strict JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import platform
import re
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import env as settings
from ..env import cache_dir_override, disk_cache_enabled

__all__ = ["CacheRecord", "TuningCache", "TuningEntry", "default_cache_dir", "environment"]

#: Version of the file layout (``{"format", "key", "entry"}``); files of another format are misses, except
#: format 1 (before confidence statistics), whose entries are read as provisional, so they are timed again, and
#: format 2 (entries without ``samples``), read as it is. (Format 3 added ``samples``: an attnopt that reads
#: format 2 only sees these files as another layout, a miss, rather than as corrupt.)
FILE_FORMAT = 3
_PROVISIONAL_FORMATS = {1: "tuned by an older attnopt without confidence statistics; timed again on next use"}
_SAME_ENTRY_FORMATS = {2}

_CACHE_FILE = re.compile(r"[0-9a-f]{64}\.json")
_TEMP_FILE = re.compile(r"\.[0-9a-f]{64}\.json\.[0-9a-f]+\.tmp")


def default_cache_dir() -> Path:
    """Where tuning results live: ``$ATTNOPT_CACHE_DIR``, else the user cache directory.

    The user cache directory is ``$XDG_CACHE_HOME/attnopt`` or ``~/.cache/attnopt`` on Linux,
    ``~/Library/Caches/attnopt`` on macOS and ``%LOCALAPPDATA%\\attnopt\\Cache`` on Windows
    (``platformdirs.user_cache_dir("attnopt")`` when that package is installed).
    """
    explicit = cache_dir_override()
    if explicit:
        return Path(explicit).expanduser()
    try:
        import platformdirs
    except ImportError:
        pass
    else:
        return Path(platformdirs.user_cache_dir("attnopt", appauthor=False))
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "attnopt"
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "attnopt" / "Cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnopt"


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device | str) -> dict[str, str]:
    """What a timing depends on besides the shape: versions, the device and its setup.

    >>> environment(torch.device("cpu"))  # doctest: +SKIP
    {'attnopt': '0.1.0', 'torch': '2.13.0+cpu', 'device_type': 'cpu',
     'device_name': 'AMD EPYC 7B13', 'threads': '2'}

    CUDA devices add the capability and the CUDA (or HIP) version torch was built with;
    CPUs add torch's intra-op thread count.
    """
    device = torch.device(device)
    env = {"attnopt": str(settings.__version__), "torch": str(torch.__version__), "device_type": device.type}
    if device.type == "cpu":
        env["device_name"] = _cpu_name()
        env["threads"] = str(torch.get_num_threads())
    elif device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        major, minor = torch.cuda.get_device_capability(index)
        env["device_name"] = torch.cuda.get_device_name(index)
        env["capability"] = f"{major}.{minor}"
        env["cuda"] = str(torch.version.hip or torch.version.cuda)
    else:
        backend = getattr(torch, device.type, None)
        get_name = getattr(backend, "get_device_name", None)
        env["device_name"] = str(get_name(device.index or 0)) if callable(get_name) else device.type
    return env


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data (dicts with str keys, lists, str, int, finite float, bool, None)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; keys hold finite numbers only")
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has the non-string key {k!r}; use string keys")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):  # torch.Size is a tuple
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__} ({value!r}); a tuning key holds concrete values "
                    "only: str, int, float, bool, None, torch.dtype, torch.device, and lists/tuples/dicts of them")


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(_plain(key, "key"), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class TuningEntry:
    """The result of tuning one key.

    Attributes:
        choice: name of the candidate to run.
        timings_ms: median time per candidate in milliseconds; ``inf`` for one that raised or
            was rejected.
        peak_bytes: peak memory per candidate, in bytes.
        rejected: candidate name -> why it was not timed or not kept.
        created: when the tuning ran (ISO 8601, UTC).
        tuning_s: how long the tuning took, in seconds.
        provisional: the choice was not separated from the runner-up with confidence (or was made by an
            older attnopt, or was marked by ``attnopt cache retune``): it serves this process, and is timed
            again by the next process or the next ``attnopt.tune``.
        decision: why ``choice`` won, in one sentence (the runner-up and the ratio's interval).
        rounds: timing rounds each candidate ran.
        spread_ms: ``(q1, q3)``, the interquartile range of each candidate's times, in milliseconds.
        ratios: ``(median, lo, hi)`` of each other timed candidate's per-round ratio to ``choice``
            (above 1: slower than the choice), with its interval at ``confidence``.
        pruned: candidate -> why it stopped being timed (clearly slower over several rounds).
        confidence: the level of the intervals (0: unknown, e.g. an entry from an older attnopt).
        load: the 1-minute load average before and after the timing (empty where the OS has none).
        samples: the seconds of each timed candidate's call in every round, kept only where the selector's
            time limit cut the race (``Selector(time_limit_s=...)``): the next tuning of the key continues
            those rounds instead of starting again. Empty otherwise.
    """

    choice: str
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)
    created: str = dataclasses.field(default_factory=_now)
    tuning_s: float = 0.0
    provisional: bool = False
    decision: str = ""
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    spread_ms: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    ratios: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    pruned: dict[str, str] = dataclasses.field(default_factory=dict)
    confidence: float = 0.0
    load: tuple[float, ...] = ()
    samples: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.choice, str) or not self.choice:
            raise ValueError(f"choice must be a candidate name, got {self.choice!r}")
        for name, ms in self.timings_ms.items():
            if not _number(ms) or math.isnan(ms) or ms < 0:
                raise ValueError(f"timings_ms[{name!r}] must be a time in ms >= 0 or inf, got {ms!r}")
        for name, n in self.peak_bytes.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"peak_bytes[{name!r}] must be a byte count >= 0, got {n!r}")
        for field in ("rejected", "pruned"):
            for name, reason in getattr(self, field).items():
                if not isinstance(reason, str):
                    raise ValueError(f"{field}[{name!r}] must be the reason as a string, got {reason!r}")
        if not isinstance(self.created, str):
            raise ValueError(f"created must be an ISO 8601 time string, got {self.created!r}")
        if not _number(self.tuning_s) or not self.tuning_s >= 0:
            raise ValueError(f"tuning_s must be seconds >= 0, got {self.tuning_s!r}")
        if not isinstance(self.provisional, bool) or not isinstance(self.decision, str):
            raise ValueError(f"provisional must be a bool and decision a string, got {self.provisional!r} "
                             f"and {self.decision!r}")
        for name, n in self.rounds.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"rounds[{name!r}] must be a count >= 0, got {n!r}")
        # JSON gives lists: hold tuples, so an entry read back equals the one stored
        for field, size in (("spread_ms", 2), ("ratios", 3)):
            values = {}
            for name, v in getattr(self, field).items():
                if (not isinstance(v, (list, tuple)) or len(v) != size
                        or not all(_number(x) and math.isfinite(x) and x >= 0 for x in v)):
                    raise ValueError(f"{field}[{name!r}] must be {size} finite numbers >= 0, got {v!r}")
                values[name] = tuple(float(x) for x in v)
            object.__setattr__(self, field, values)
        if not _number(self.confidence) or not 0 <= self.confidence < 1:
            raise ValueError(f"confidence must be a level in [0, 1), got {self.confidence!r}")
        if not isinstance(self.load, (list, tuple)) or not all(_number(x) and x >= 0 for x in self.load):
            raise ValueError(f"load must be load averages >= 0, got {self.load!r}")
        object.__setattr__(self, "load", tuple(float(x) for x in self.load))
        samples = {}
        for name, times in self.samples.items():
            if (not isinstance(times, (list, tuple))
                    or not all(_number(x) and math.isfinite(x) and x >= 0 for x in times)):
                raise ValueError(f"samples[{name!r}] must be seconds >= 0 per round, got {times!r}")
            samples[name] = tuple(float(x) for x in times)
        object.__setattr__(self, "samples", samples)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # an entry pickled by an older attnopt (inside a pickled Selector) lacks the fields added since: defaults
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(self) if f.name not in state}
        self.__dict__.update({**defaults, **state})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; ``inf`` timings become ``None``."""
        data = dataclasses.asdict(self)
        data["timings_ms"] = {k: (float(v) if math.isfinite(v) else None) for k, v in self.timings_ms.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuningEntry:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming what is missing or malformed."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a tuning entry is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if "choice" not in data or set(data) - names:
            raise ValueError(f"a tuning entry has the fields {sorted(names)} ('choice' required), got {sorted(data)}")
        fields = dict(data)
        for name in ("timings_ms", "peak_bytes", "rejected", "rounds", "spread_ms", "ratios", "pruned", "samples"):
            if not isinstance(fields.get(name, {}), Mapping):
                raise ValueError(f"{name} must be a JSON object, got {fields[name]!r}")
        fields["timings_ms"] = {k: (math.inf if v is None else v) for k, v in fields.get("timings_ms", {}).items()}
        return cls(**fields)

    def to_json(self) -> str:
        """Strict JSON text (``inf`` timings as ``null``)."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> TuningEntry:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """One file of the cache: where it is, the full key it answers and its entry."""

    path: Path
    key: dict[str, Any]
    entry: TuningEntry

    @property
    def id(self) -> str:
        """The key's hash (the file name without ``.json``); a prefix of it names the entry on the command line."""
        return self.path.stem


def _older(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


class TuningCache:
    """Tuning results keyed by environment, candidate set and shape, in memory and on disk.

    Args:
        directory: where the files go; ``None`` means :func:`default_cache_dir` (read now).
            The disk layer is off when ``ATTNOPT_CACHE=0`` (read now).
    """

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.disk = disk_cache_enabled()
        self._writable = True
        self._memory: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a pickled optimized model: the lock is the process's own
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = str(self.directory) if self.disk else "memory only (ATTNOPT_CACHE off)"
        return f"TuningCache({where}, {len(self._memory)} in memory)"

    def key(self, shape_key: Mapping[str, Any], candidates: Sequence[str], device: torch.device | str) -> dict:
        """The full key: ``{"environment": ..., "candidates": sorted names, "shape": shape_key}`` as JSON data."""
        if isinstance(candidates, str) or not all(isinstance(c, str) and c for c in candidates):
            raise TypeError(f"candidates must be a sequence of candidate names, got {candidates!r}")
        if not candidates:
            raise ValueError("candidates is empty; a tuning key needs the candidate set that was timed")
        key = {"environment": environment(device), "candidates": sorted(set(candidates)),
               "shape": _plain(shape_key, "shape_key")}
        return json.loads(_canonical(key))

    def path_for(self, key: Mapping[str, Any]) -> Path:
        """The file that holds ``key``'s entry (whether or not it exists)."""
        return self.directory / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()}.json"

    def lookup(self, key: Mapping[str, Any]) -> TuningEntry | None:
        """The entry stored for ``key``, or ``None`` (never tuned, other key in the file, unreadable file)."""
        canonical = _canonical(key)
        with self._lock:
            data = self._memory.get(canonical)
        if data is not None:
            return TuningEntry.from_dict(data)
        if not self.disk:
            return None
        entry = self._read(self.path_for(key), canonical)
        if entry is not None:
            with self._lock:
                self._memory[canonical] = entry.to_dict()
        return entry

    def store(self, key: Mapping[str, Any], entry: TuningEntry) -> None:
        """Keep ``entry`` for ``key`` in memory and (atomically) on disk, replacing any earlier one."""
        if not isinstance(entry, TuningEntry):
            raise TypeError(f"store() takes a TuningEntry, got {type(entry).__name__}")
        canonical = _canonical(key)
        data = entry.to_dict()
        with self._lock:
            self._memory[canonical] = data
        if self.disk and self._writable:
            record = {"format": FILE_FORMAT, "key": json.loads(canonical), "entry": data}
            self._write(self.path_for(key), json.dumps(record, sort_keys=True, indent=1, allow_nan=False))

    def records(self) -> list[CacheRecord]:
        """Every readable entry in the directory, oldest first (unreadable, corrupt or foreign files are
        skipped silently: a listing is not the place to warn about them)."""
        if not self.directory.is_dir():
            return []
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for path in self.directory.iterdir():
                found = self._load(path) if _CACHE_FILE.fullmatch(path.name) else None
                if found is not None:
                    out.append(CacheRecord(path, *found))
        out.sort(key=lambda r: (r.entry.created, r.path.name))
        return out

    def remove(self, key: Mapping[str, Any]) -> bool:
        """Forget ``key``'s entry (memory and file); whether a file was removed."""
        with self._lock:
            self._memory.pop(_canonical(key), None)
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> int:
        """Forget every entry: the in-memory layer and this cache's files in the directory (how many). A
        temporary file younger than a minute is another process's write in flight, and is left to it."""
        with self._lock:
            self._memory.clear()
        if not self.disk or not self.directory.is_dir():
            return 0
        removed = 0
        for path in self.directory.iterdir():
            if _CACHE_FILE.fullmatch(path.name) or _TEMP_FILE.fullmatch(path.name) and _older(path, 60.0):
                try:
                    path.unlink()
                    removed += 1
                except FileNotFoundError:  # removed by another process meanwhile
                    pass
        return removed

    def unreadable(self) -> int:
        """How many of this cache's files in the directory hold no readable entry (corrupt, edited by hand,
        another layout), and left-over temporary files; ``clear`` removes them."""
        if not self.directory.is_dir():
            return 0
        count = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for path in self.directory.iterdir():
                if _CACHE_FILE.fullmatch(path.name) and self._load(path) is None \
                        or _TEMP_FILE.fullmatch(path.name) and _older(path, 60.0):
                    count += 1
        return count

    def _read(self, path: Path, canonical: str) -> TuningEntry | None:
        found = self._load(path)
        if found is None or _canonical(found[0]) != canonical:
            return None  # nothing there, or another key under this name
        return found[1]

    def _load(self, path: Path) -> tuple[dict[str, Any], TuningEntry] | None:
        """The key and entry in ``path``; None for a missing, foreign, unreadable or corrupt file (the
        last two with a warning)."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            warnings.warn(f"attnopt: ignoring the unreadable tuning cache file {path} ({e}); "
                          "it is tuned again and overwritten", stacklevel=4)
            return None
        try:
            record = json.loads(text)
            fmt = record.get("format") if isinstance(record, dict) else None
            if fmt != FILE_FORMAT and fmt not in _PROVISIONAL_FORMATS and fmt not in _SAME_ENTRY_FORMATS:
                return None  # another layout: a foreign file or another attnopt version
            key = record["key"]
            if not isinstance(key, dict):
                raise TypeError(f"the key is a {type(key).__name__}, not a JSON object")
            for part, kind in (("environment", dict), ("candidates", list), ("shape", dict)):
                if not isinstance(key.get(part), kind):
                    raise TypeError(f"the key's {part!r} is a {type(key.get(part)).__name__}, not a {kind.__name__}")
            if path.name != self.path_for(key).name:  # (_canonical raises ValueError for NaN in a key)
                return None  # another key under this name: written elsewhere, or edited by hand
            entry = TuningEntry.from_dict(record["entry"])
            if fmt in _PROVISIONAL_FORMATS:
                entry = dataclasses.replace(entry, provisional=True, decision=_PROVISIONAL_FORMATS[fmt])
            return key, entry
        except (ValueError, TypeError, KeyError) as e:
            warnings.warn(f"attnopt: ignoring the corrupt tuning cache file {path} ({type(e).__name__}: {e}); "
                          "it is tuned again and overwritten", stacklevel=4)
            return None

    def _write(self, path: Path, text: str, again: bool = True) -> None:
        temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_EXCL: the name is ours alone; mode 0o666 lets the umask decide who may read it
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temp, path)
        except OSError as e:
            if isinstance(e, FileNotFoundError) and again and path.parent.is_dir():
                return self._write(path, text, again=False)  # the temporary file was removed meanwhile (a clear)
            with contextlib.suppress(OSError):
                temp.unlink()
            self._writable = False
            warnings.warn(f"attnopt: cannot write the tuning cache in {self.directory} ({e}); tuning results are "
                          "kept in memory for this process only. Set ATTNOPT_CACHE_DIR to a writable directory, "
                          "or ATTNOPT_CACHE=0 to silence this.", stacklevel=3)
