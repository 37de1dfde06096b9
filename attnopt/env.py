"""One source for what the whole package reads: its version, the variant names, the environment knobs.

Every ``ATTNOPT_*`` variable is read here, at call time (tests and users may set them after import):

* ``ATTNOPT_VARIANT``: overrides the ``variant`` of :func:`attnopt.optimize` (:func:`variant_override`);
* ``ATTNOPT_STRICT=1``: sites re-check every tensor a proof read on every call (:func:`strict_guards`);
* ``ATTNOPT_CACHE=0``: the tuning cache keeps results in memory only (:func:`disk_cache_enabled`);
* ``ATTNOPT_CACHE_DIR``: where the tuning cache lives (:func:`cache_dir_override`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

__version__ = "0.1.0"

#: The variant that makes a site ask its selector per shape key.
AUTO = "auto"
#: The variant that rewrites nothing (an A/B baseline).
EAGER = "eager"
#: Variant names accepted besides the registered candidates' names.
VARIANTS = (AUTO, "sdpa", EAGER)


@functools.cache
def source_key() -> str:
    """A digest of attnopt's own source: what a graph compiled with attnopt's sites was traced by.

    Inductor's on-disk caches key a graph handed to them by its code and its modules' state, not by the
    code of those modules: a compiled graph from another attnopt (an upgrade, an edited checkout) would
    otherwise be served for the same graph. The backend stores this on every site before compiling."""
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_OFF_VALUES = frozenset(("0", "off", "false", "no"))
_ON_VALUES = frozenset(("", "1", "on", "true", "yes"))


def variant_override() -> str:
    """``$ATTNOPT_VARIANT``, or ``""`` when unset."""
    return os.environ.get("ATTNOPT_VARIANT", "").strip()


def strict_guards() -> bool:
    """``ATTNOPT_STRICT=1``: re-check the content of every tensor a proof read on every call.

    For code that writes proof inputs in ways PyTorch's version counter does not see
    (``.data``, ``.numpy()``, DLPack, ``set_``).
    """
    return _flag("ATTNOPT_STRICT", default=False)


def disk_cache_enabled() -> bool:
    """``$ATTNOPT_CACHE``: False for ``0``/``off``/``false``/``no``; a clear error for values it cannot read."""
    return _flag("ATTNOPT_CACHE", default=True)


def _flag(name: str, default: bool) -> bool:
    """An on/off environment variable: unset or empty is ``default``; a value it cannot read is an error."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _OFF_VALUES:
        return False
    if value in _ON_VALUES:
        return True
    raise ValueError(f"{name}={value!r} is not understood; set it to '0'/'off'/'false'/'no' or "
                     "'1'/'on'/'true'/'yes' (or leave it unset)")


def cache_dir_override() -> str | None:
    """``$ATTNOPT_CACHE_DIR``, or None when unset or empty."""
    return os.environ.get("ATTNOPT_CACHE_DIR") or None

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str | None, what: str = "memory_budget") -> int | None:
    """``512 * 2**20``, ``"512MiB"``, ``"2GB"`` or None -> bytes (or None); errors name the option ``what``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be a number of bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        if unit not in _UNITS or not digits:
            raise ValueError(f"cannot read {what} {value!r}; write bytes as an int or e.g. '512MiB', '2GB'")
        n = int(float(digits) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return n
