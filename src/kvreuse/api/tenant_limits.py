"""What each tenant may use: ``--tenant-limits FILE`` and the ``--tenant-max-in-flight`` /
``--tenant-tokens-per-minute`` defaults, the same on ``kvreuse serve`` and ``kvreuse route``.

The file is TOML (``.toml``) or JSON (``.json``)::

    [default]                 # every tenant key without an entry of its own
    max_in_flight = 4         # requests running at once (streams count until they end)
    tokens_per_minute = 20000 # prompt + completion tokens (kvreuse.api.limiter)

    [tenants.acme]            # a tenant named by --api-key KEY:acme
    max_in_flight = 16        # tokens_per_minute comes from [default]

    [tenants.batch]
    tokens_per_minute = "unlimited"

    [admin]                   # the admin keys (KEY without :TENANT), together; unlimited unless set
    max_in_flight = 64

A value is a whole number >= 1, or ``"unlimited"`` (JSON ``null`` too). A tenant's missing
settings come from ``[default]``; ``[admin]`` does not inherit. The flags set ``[default]``'s
values and win over the file's. Every error names the setting to change.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreuse.api.tenants import TENANT_NAME, APIKeys

SETTINGS = ("max_in_flight", "tokens_per_minute")
SECTIONS = ("default", "tenants", "admin")
UNLIMITED = "unlimited"
FILE_FLAG = "--tenant-limits"
FLAGS = {"max_in_flight": "--tenant-max-in-flight", "tokens_per_minute": "--tenant-tokens-per-minute"}


@dataclass(frozen=True)
class Limits:
    """One tenant's limits; ``None`` is unlimited."""

    max_in_flight: int | None = None
    tokens_per_minute: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.max_in_flight is None and self.tokens_per_minute is None


@dataclass(frozen=True)
class TenantLimits:
    """Resolved limits: ``tenants`` hold their own (defaults filled in), every other tenant
    gets ``default``, the admin keys (``tenant`` ``None``) get ``admin``."""

    default: Limits = Limits()
    tenants: Mapping[str, Limits] = field(default_factory=dict)
    admin: Limits = Limits()

    def of(self, tenant: str | None) -> Limits:
        if tenant is None:
            return self.admin
        return self.tenants.get(tenant, self.default)

    def check_keys(self, keys: APIKeys | None) -> None:
        """Raises ``ValueError`` for a ``[tenants.X]`` no ``--api-key KEY:X`` names (a typo
        would leave the tenant on the defaults), or for limits that apply to no key."""
        known = [] if keys is None else sorted(keys.tenant_names)
        for name in self.tenants:
            if name not in known:
                raise ValueError(
                    f"{FILE_FLAG}: tenants.{name}: no --api-key KEY:{name} names this tenant "
                    f"(tenants with keys: {', '.join(known) or 'none'})"
                )
        if not known and self.admin.unlimited:
            raise ValueError(
                f"{FILE_FLAG} / {FLAGS['max_in_flight']} / {FLAGS['tokens_per_minute']}: no --api-key "
                "KEY:TENANT names a tenant and [admin] sets nothing, so these limits apply to no request"
            )


def _value(raw: Any, where: str) -> int | None:
    if raw is None or raw == UNLIMITED:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"{where}: expected a whole number >= 1 or \"{UNLIMITED}\", got {raw!r}")
    return raw


def _section(raw: Any, where: str) -> dict[str, int | None]:
    """The settings a table gives (absent ones are left out, to be inherited)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table of {' / '.join(SETTINGS)}, got {raw!r}")
    for name in raw:
        if name not in SETTINGS:
            raise ValueError(f"{where}.{name}: unknown setting; expected {' or '.join(SETTINGS)}")
    return {name: _value(raw[name], f"{where}.{name}") for name in SETTINGS if name in raw}


def parse_limits(
    data: Any, source: str = FILE_FLAG, *, max_in_flight: int | None = None, tokens_per_minute: int | None = None
) -> TenantLimits:
    """``TenantLimits`` from the file's parsed content (``data``; ``None``: no file) and the
    default flags. Raises ``ValueError`` naming the setting (prefixed by ``source``)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a table with {', '.join(SECTIONS)}, got {type(data).__name__}")
    for name in data:
        if name not in SECTIONS:
            raise ValueError(f"{source}: {name}: unknown section; expected {', '.join(SECTIONS)}")
    default = _section(data.get("default", {}), f"{source}: default")
    for setting, value in (("max_in_flight", max_in_flight), ("tokens_per_minute", tokens_per_minute)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{FLAGS[setting]}: expected a whole number >= 1, got {value!r}")
            default[setting] = value
    tenants_raw = data.get("tenants", {})
    if not isinstance(tenants_raw, dict):
        raise ValueError(f"{source}: tenants: expected a table of tenant names, got {tenants_raw!r}")
    tenants = {}
    for name, raw in tenants_raw.items():
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{source}: tenants.{name}: a tenant name is 1-64 letters, digits, '_', '.' or '-'")
        tenants[name] = Limits(**{**default, **_section(raw, f"{source}: tenants.{name}")})
    return TenantLimits(Limits(**default), tenants, Limits(**_section(data.get("admin", {}), f"{source}: admin")))


def load_limits(
    path: str | None, *, max_in_flight: int | None = None, tokens_per_minute: int | None = None
) -> TenantLimits | None:
    """The limits of ``--tenant-limits path`` and the default flags; ``None`` when none of
    them is given. Raises ``ValueError`` naming the file, the setting and what is wrong."""
    if path is None and max_in_flight is None and tokens_per_minute is None:
        return None
    data = None
    source = FILE_FLAG
    if path is not None:
        source = f"{FILE_FLAG} {path}"
        suffix = Path(path).suffix.lower()
        if suffix not in (".toml", ".json"):
            raise ValueError(f"{source}: the file must end in .toml or .json (got {suffix or 'no suffix'})")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: cannot read it: {exc}") from None
        try:
            data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            raise ValueError(f"{source}: not valid {suffix[1:].upper()}: {exc}") from None
    return parse_limits(data, source, max_in_flight=max_in_flight, tokens_per_minute=tokens_per_minute)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--tenant-limits FILE``, ``--tenant-max-in-flight N``, ``--tenant-tokens-per-minute N``,
    the same on ``kvreuse serve`` and ``kvreuse route``."""
    p.add_argument(
        FILE_FLAG,
        default=None,
        metavar="FILE",
        help="per-tenant limits, TOML or JSON: [default], [tenants.NAME] and [admin] tables of "
        "max_in_flight and tokens_per_minute (docs/router.md#tenant-limits); over a limit: 429",
    )
    p.add_argument(
        FLAGS["max_in_flight"],
        type=int,
        default=None,
        metavar="N",
        help="requests each tenant key may have running at once (a stream until it ends); sets [default] max_in_flight",
    )
    p.add_argument(
        FLAGS["tokens_per_minute"],
        type=int,
        default=None,
        metavar="N",
        help="prompt + completion tokens each tenant key may use per minute (prompt + max_tokens "
        "reserved at admission, corrected to the usage at the end); sets [default] tokens_per_minute",
    )


def limits_from_args(args: argparse.Namespace) -> TenantLimits | None:
    """``load_limits`` of the flags ``add_arguments`` added (``None``: none given)."""
    return load_limits(
        args.tenant_limits, max_in_flight=args.tenant_max_in_flight, tokens_per_minute=args.tenant_tokens_per_minute
    )
