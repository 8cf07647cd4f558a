"""``--tenant-limits FILE`` (TOML or JSON) and the default flags: what they resolve to, and
the error naming the setting for every way of getting them wrong."""

from __future__ import annotations

import json

import pytest

from kvreuse.api.tenant_limits import Limits, TenantLimits, load_limits, parse_limits
from kvreuse.api.tenants import APIKeys

TOML = """
[default]
max_in_flight = 4
tokens_per_minute = 20000

[tenants.acme]
max_in_flight = 16

[tenants.batch]
tokens_per_minute = "unlimited"

[admin]
max_in_flight = 64
"""


def test_a_toml_file_resolves_each_tenant_from_its_table_and_the_defaults(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text(TOML)
    limits = load_limits(str(path))
    assert limits == TenantLimits(
        default=Limits(4, 20000),
        tenants={"acme": Limits(16, 20000), "batch": Limits(4, None)},
        admin=Limits(64, None),  # [admin] inherits nothing
    )
    assert [limits.of(t) for t in ("acme", "batch", "other", None)] == [
        Limits(16, 20000),
        Limits(4, None),
        Limits(4, 20000),
        Limits(64, None),
    ]


def test_json_is_the_same_and_null_is_unlimited(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(
        json.dumps(
            {
                "default": {"tokens_per_minute": 100},
                "tenants": {"acme": {"tokens_per_minute": None, "max_in_flight": 2}},
            }
        )
    )
    assert load_limits(str(path)) == TenantLimits(Limits(None, 100), {"acme": Limits(2, None)}, Limits())


def test_the_flags_set_the_defaults_and_win_over_the_file(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text(TOML)
    limits = load_limits(str(path), max_in_flight=1, tokens_per_minute=500)
    assert (limits.default, limits.tenants["acme"], limits.tenants["batch"]) == (
        Limits(1, 500),
        Limits(16, 500),
        Limits(1, None),
    )
    assert load_limits(None, tokens_per_minute=60) == TenantLimits(default=Limits(None, 60))
    assert load_limits(None) is None  # nothing given: no limiter at all


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"default": {"max_in_flight": 0}},
            '--tenant-limits: default.max_in_flight: expected a whole number >= 1 or "unlimited", got 0',
        ),
        (
            {"default": {"tokens_per_minute": 1.5}},
            '--tenant-limits: default.tokens_per_minute: expected a whole number >= 1 or "unlimited", got 1.5',
        ),
        (
            {"tenants": {"acme": {"max_in_flight": True}}},
            '--tenant-limits: tenants.acme.max_in_flight: expected a whole number >= 1 or "unlimited", got True',
        ),
        (
            {"tenants": {"acme": {"max_inflight": 2}}},
            "--tenant-limits: tenants.acme.max_inflight: unknown setting; expected max_in_flight or tokens_per_minute",
        ),
        ({"tenant": {}}, "--tenant-limits: tenant: unknown section; expected default, tenants, admin"),
        (
            {"tenants": {"bad name": {}}},
            "--tenant-limits: tenants.bad name: a tenant name is 1-64 letters, digits, '_', '.' or '-'",
        ),
        ({"admin": 3}, "--tenant-limits: admin: expected a table of max_in_flight / tokens_per_minute, got 3"),
        ([1], "--tenant-limits: expected a table with default, tenants, admin, got list"),
    ],
)
def test_bad_settings_are_named(data, message):
    with pytest.raises(ValueError) as info:
        parse_limits(data)
    assert str(info.value) == message


def test_bad_flags_and_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"^--tenant-max-in-flight: expected a whole number >= 1, got 0$"):
        load_limits(None, max_in_flight=0)
    with pytest.raises(ValueError, match=r"^--tenant-tokens-per-minute: expected a whole number >= 1, got -5$"):
        load_limits(None, tokens_per_minute=-5)
    yaml = tmp_path / "limits.yaml"
    yaml.write_text("default: {}")
    with pytest.raises(ValueError, match=r"limits.yaml: the file must end in .toml or .json \(got .yaml\)$"):
        load_limits(str(yaml))
    with pytest.raises(ValueError, match=r"^--tenant-limits .*missing.toml: cannot read it: \[Errno 2\]"):
        load_limits(str(tmp_path / "missing.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[default\n")
    with pytest.raises(ValueError, match=r"broken.toml: not valid TOML: "):
        load_limits(str(broken))
    typo = tmp_path / "typo.json"
    typo.write_text('{"default": {"tokens_per_minute": 0}}')
    with pytest.raises(ValueError, match=r"typo.json: default.tokens_per_minute: expected a whole number >= 1"):
        load_limits(str(typo))


def test_limits_must_name_tenants_that_have_keys():
    keys = APIKeys.parse(["admin-key", "a-key:acme"])
    TenantLimits(Limits(2), {"acme": Limits(4)}).check_keys(keys)
    with pytest.raises(ValueError) as typo:
        TenantLimits(Limits(2), {"acmee": Limits(4)}).check_keys(keys)
    assert str(typo.value) == (
        "--tenant-limits: tenants.acmee: no --api-key KEY:acmee names this tenant (tenants with keys: acme)"
    )
    with pytest.raises(ValueError) as nobody:
        TenantLimits(Limits(2)).check_keys(APIKeys.parse(["admin-key"]))
    assert str(nobody.value) == (
        "--tenant-limits / --tenant-max-in-flight / --tenant-tokens-per-minute: no --api-key "
        "KEY:TENANT names a tenant and [admin] sets nothing, so these limits apply to no "
        "request"
    )
    TenantLimits(admin=Limits(8)).check_keys(None)  # admin limits with no keys: every request is an admin's
