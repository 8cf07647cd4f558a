"""`kvreuse schema`: errors are one line and exit code 2, never a traceback."""

from kvreuse.schema_cli import schema_main


def test_unreachable_server_is_a_clear_error(capsys):
    assert schema_main(["list", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:1/v1/schemas" in err and "Traceback" not in err


def test_schema_precompute_can_target_a_quantized_server():
    # serve.sh (the quick start) serves --quantization int4; module files are keyed by model_id,
    # which now includes the scheme, but `kvreuse schema precompute` cannot produce them.
    from kvreuse.schema_cli import _parser

    args = _parser().parse_args(["precompute", "s.pml", "--schema-dir", "d", "--quantization", "int4"])
    assert args.quantization == "int4"


def test_schema_precompute_can_target_a_server_of_either_mode():
    # module files are keyed by model_id, which folds in the deterministic mode: precompute takes
    # the server's --[no-]deterministic (default: auto, as serve)
    from kvreuse.schema_cli import _engine_config, _parser

    base = ["precompute", "s.pml", "--schema-dir", "d"]
    assert _engine_config(_parser().parse_args(base)).deterministic is None
    assert _engine_config(_parser().parse_args([*base, "--no-deterministic"])).deterministic is False
    assert _engine_config(_parser().parse_args([*base, "--deterministic"])).deterministic is True
