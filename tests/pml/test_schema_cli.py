"""`kvreuse schema`: errors are one line and exit code 2, never a traceback."""

from kvreuse.pml.schema_cli import schema_main


def test_unreachable_server_is_a_clear_error(capsys):
    assert schema_main(["list", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:1/v1/schemas" in err and "Traceback" not in err
