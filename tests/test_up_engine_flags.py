"""`kvpush up` forwards engine flags (issue 66, point 5): `kvpush serve` flags after --
go to every instance, --prefill-args/--decode-args to one role; they are checked with
serve's own parser (its "did you mean", its refusals of vLLM flags) before anything
starts, and the flags `up` sets itself are refused with the `up` flag to use. A serve
flag given to `up` directly is answered with the form that works. Parser level: nothing
is started."""

from __future__ import annotations

import pytest

from kvpush.cli import build_parser
from kvpush.cluster.cli import check_serve_flags, instance_roles, serve_argv


def _up(*argv: str):
    return build_parser().parse_args(["up", *argv])


def _error(capsys, *argv: str) -> str:
    """stderr of a usage error (status 2), while parsing or checking the flags."""
    with pytest.raises(SystemExit) as e:
        args = _up(*argv)
        check_serve_flags(args, instance_roles(args))
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _serve_args(argv: list[str]):
    """The instance's command line as `kvpush serve` parses it."""
    cut = argv.index("serve")
    return build_parser().parse_args(argv[cut:])


def test_flags_after_the_separator_reach_every_instance_and_role_flags_one_role():
    args = _up("m", "--decode", "2", "--decode-args", "--max-num-seqs 4 --enable-prefix-caching",
               "--prefill-args=--no-prefix-caching", "--",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "8")
    check_serve_flags(args, instance_roles(args))  # passes
    p = _serve_args(serve_argv(args, "m", "prefill", 9001, 1))
    d = _serve_args(serve_argv(args, "m", "decode", 9002, 1))
    assert (p.role, p.port, p.max_num_batched_tokens, p.max_num_seqs) == ("prefill", 9001, 64, 8)
    assert (d.role, d.port, d.max_num_batched_tokens, d.max_num_seqs) == ("decode", 9002, 64, 4)
    assert p.enable_prefix_caching is False and d.enable_prefix_caching is True
    assert args.model_pos == "m"


def test_a_serve_flag_given_to_up_points_at_the_form_that_works(capsys):
    err = _error(capsys, "--max-num-seqs", "8")
    assert "usage: kvpush up [MODEL] [flags] [-- SERVE_FLAGS]" in err
    assert "--max-num-seqs: a `kvpush serve` flag" in err
    assert "kvpush up [MODEL] -- --max-num-seqs" in err and "--decode-args" in err
    assert "did you mean" not in err  # not up's closest flag: the form that works


@pytest.mark.parametrize("argv, says", [
    (["--", "--max-num-seq", "8"], "did you mean --max-num-seqs?"),
    (["--decode-args", "--max-num-seq 8"],
     "kvpush up (serve flags of the decode instances): error: unrecognized arguments"),
    (["--", "--port", "9"], "--port is set by kvpush up (up picks free ports"),
    (["--", "--role", "decode"], "--role is set by kvpush up (up's --prefill N"),
    (["--", "-tp", "2"], "-tp is set by kvpush up (up's -tp, --prefill-tp, --decode-tp)"),
    (["--", "--gpu-memory-utilization", "0.9"], "use --kv-cache-memory SIZE"),
    (["--", "--max-num-seqs", "x"], "invalid"),
])
def test_engine_flags_are_checked_with_serves_parser(capsys, argv, says):
    assert says in _error(capsys, *argv)


def test_colocated_gets_the_common_flags():
    args = _up("--mode", "colocated", "--", "--max-num-seqs", "3")
    assert instance_roles(args) == ["both"]
    check_serve_flags(args, ["both"])
    assert _serve_args(serve_argv(args, "m", "both", 9003, 1)).max_num_seqs == 3
