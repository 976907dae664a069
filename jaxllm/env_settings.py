"""How the ``JAXLLM_*`` switches that change compiled programs are read from the environment:
a value from a fixed set, its default ("off" unless the switch says) when unset or blank,
surrounding spaces ignored, and a clear error naming the variable for anything else. What
each switch does is documented beside its use; every one is listed in the executable cache's
key (``executable_cache.PROGRAM_ENV``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def env_choice(environ: Mapping[str, str], name: str, choices: Collection[str],
               default: str = "off") -> str:
    """``name``'s value, one of ``choices`` (``default`` when unset or blank)."""
    value = environ.get(name, "").strip() or default
    if value not in choices:
        allowed = (" or ".join(repr(c) for c in choices) if len(choices) == 2
                   else f"one of {sorted(choices)}")
        raise ValueError(f"{name}={value!r} must be {allowed}")
    return value


def env_switch(environ: Mapping[str, str], name: str, default: str = "off") -> bool:
    """Whether the on/off switch ``name`` is "on" (``default`` when unset or blank)."""
    return env_choice(environ, name, ("off", "on"), default) == "on"
