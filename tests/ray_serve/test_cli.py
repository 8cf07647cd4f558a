"""``kvreuse ray``'s flags: its own and ``kvreuse route``'s go to the ingress, the rest to every
replica's ``kvreuse serve``; keys and tenant limits are checked at the ingress, which calls the
replicas with an admin key of its own. No cluster is started."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from kvreuse.ray_serve.app import RayAppOptions
from kvreuse.ray_serve.cli import options_from_argv
from kvreuse.ray_serve.ingress import parse_route_argv
from kvreuse.ray_serve.replica import parse_serve_argv


def test_flags_split_between_the_ingress_and_the_replicas():
    argv = ["--replicas", "3", "--model", "tiny:llama", "--port", "9000", "--routing-policy", "round_robin"]
    argv += ["--max-num-seqs", "8", "--migration-limit", "2", "--request-router", "pow2"]
    options, serve, _ = options_from_argv(argv)
    assert options.replicas == 3 and options.request_router == "pow2"
    assert options.serve_args == ["--model", "tiny:llama", "--port", "9000", "--max-num-seqs", "8"]
    assert serve.port == 9000 and serve.max_num_seqs == 8
    assert options.route_args == [
        "--routing-policy",
        "round_robin",
        "--migration-limit",
        "2",
        "--startup-timeout",
        "600",
        "--max-body-bytes",
        str(8 * 1024 * 1024),
    ]
    route = parse_route_argv(options.route_args)  # what the ingress parses
    assert (route.routing_policy, route.migration_limit, route.startup_timeout) == ("round_robin", 2, 600.0)


def test_keys_and_limits_go_to_the_ingress_and_the_replicas_get_its_admin_key():
    argv = ["--model", "tiny:llama", "--api-key", "admin", "--api-key", "tk:alpha", "--tenant-max-in-flight", "2"]
    options, _, _ = options_from_argv(argv)
    route = parse_route_argv(options.route_args)
    internal = route.executor_api_key
    assert internal and internal not in ("admin", "tk:alpha")
    assert route.api_key == ["admin", "tk:alpha"] and route.tenant_max_in_flight == 2
    replica = parse_serve_argv(options.serve_args)
    assert replica.api_key == ["admin", "tk:alpha", internal]


def test_a_bad_serve_flag_is_refused_before_ray_starts():
    with pytest.raises(ValueError, match="bad kvreuse serve flags"):
        options_from_argv(["--model", "tiny:llama", "--no-such-flag"])


def test_app_options_check_their_values_and_say_how_replicas_scale():
    assert RayAppOptions(replicas=2).scaling() == {"num_replicas": 2}
    scaled = RayAppOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=3).scaling()
    assert scaled == {
        "autoscaling_config": {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": 4,
            "target_ongoing_requests": 3,
        }
    }
    with pytest.raises(ValueError, match="request_router"):
        RayAppOptions(request_router="random")
    with pytest.raises(ValueError, match="max_replicas"):
        RayAppOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match=r"unknown kvreuse ray option\(s\) \['replica'\]"):
        RayAppOptions.from_dict({"replica": 2})
    assert RayAppOptions.from_dict(RayAppOptions(replicas=2).to_dict()) == RayAppOptions(replicas=2)
