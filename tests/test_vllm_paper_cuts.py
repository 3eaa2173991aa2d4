"""A vLLM user's paper cuts (issue 66, point 6), each fixed or answered: chunked-prefill
flags as vLLM spells them, --generation-config and the TLS flags refused with advice,
no reference outside the repository or to a deleted script, the license as an SPDX
string, a CDF plot wide enough for its title, `bench compare`'s overall progress,
vLLM's response ids and a model folder's path as its name, `kvpush --help` in the
README's order."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from kvpush.cli import build_parser
from kvpush.server.app import new_request_id
from kvpush.server.chat import PromptBuilder

ROOT = Path(__file__).resolve().parents[1]


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_chunked_prefill_as_vllm_spells_it():
    parse = build_parser().parse_args
    assert parse(["serve", "m"]).enable_chunked_prefill is True
    assert parse(["serve", "m", "--enable-chunked-prefill"]).enable_chunked_prefill is True
    assert parse(["serve", "m", "--no-enable-chunked-prefill"]).enable_chunked_prefill is False
    assert parse(["serve", "m", "--no-chunked-prefill"]).enable_chunked_prefill is False


@pytest.mark.parametrize("argv, says", [
    (["--generation-config", "auto"], "reads only its EOS ids"),
    (["--ssl-keyfile", "k.pem"], "put a TLS proxy"),
    (["--ssl-certfile", "c.pem"], "put a TLS proxy"),
])
def test_vllm_flags_kvpush_does_not_take_say_what_to_do(capsys, argv, says):
    err = _usage_error(capsys, "serve", "m", *argv)
    assert f"does not take vLLM's {argv[0]}" in err and says in err
    assert "did you mean" not in err


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def test_nothing_points_outside_the_repository_or_at_a_deleted_script():
    files = [p for p in _tracked() if p.suffix in (".py", ".md", ".txt", ".toml", "")]
    outside = [str(p.relative_to(ROOT)) for p in files
               if "shared/PLATFORM.md" in p.read_text(errors="replace")
               and p.name != Path(__file__).name]
    assert not outside, outside
    # a benchmarks/*.py path named in the benchmarks' documents exists, or is cited from
    # the commit before the one that removed it (`git show <commit>^:path`)
    missing = []
    for md in (ROOT / "benchmarks").rglob("*.md"):
        text = md.read_text()
        for m in re.finditer(r"benchmarks/[\w/]+\.py", text):
            cited = re.search(r"git show\s+[0-9a-f]{7,}\^:" + re.escape(m.group()), text)
            if not (ROOT / m.group()).exists() and not cited:
                missing.append(f"{md.relative_to(ROOT)}: {m.group()}")
    assert not missing, missing


def test_license_is_an_spdx_string():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (req,) = meta["build-system"]["requires"]
    assert req == "setuptools>=77"  # the first to take an SPDX license string (PEP 639)


def test_one_rate_cdf_plot_is_wide_enough_for_its_title(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvpush.bench.compare_report import summarize_runs
    from kvpush.bench.plots import plot_summary
    from test_bench_compare import _canned

    cfg, runs = _canned()
    cfg.rates = [1.0]
    cfg.label = "a long label " * 6
    figs: list = []
    paths = plot_summary(summarize_runs(runs[:2], cfg), runs[:2], tmp_path, figures=figs)
    try:
        for fig, path in zip(figs, paths, strict=True):
            width = int.from_bytes(path.read_bytes()[16:20], "big")  # the PNG's IHDR
            assert width >= 1000, (path.name, width)
            fig.canvas.draw()
            box = fig._suptitle.get_window_extent()
            assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (path.name, box)
            assert "\n" in fig._suptitle.get_text()  # wrapped, not clipped
    finally:
        for f in figs:
            plt.close(f)


def test_bench_compare_says_its_overall_progress():
    from kvpush.bench.compare import progress_text
    from kvpush.bench.compare_config import CompareConfig, ModeSpec

    cfg = CompareConfig(modes=[ModeSpec("pull"), ModeSpec("push")], rates=[1.0, math.inf],
                        out_dir="unused", num_prompts=3, time_limit=1800.0)
    assert progress_text(3, 8, 90.0, cfg) == "[3/8 runs, 1.5 of 30 min]"


def test_new_ids_are_vllms():
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", new_request_id("chat"))
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_request_id("completion"))


def test_a_folder_path_names_the_model_served_from_it():
    b = PromptBuilder.__new__(PromptBuilder)
    b.model_name = "SmolLM2-135M"
    assert b.serves("SmolLM2-135M") and b.serves("/models/SmolLM2-135M")
    assert b.serves("./SmolLM2-135M/") and b.serves("~/m/SmolLM2-135M")
    assert not b.serves("/models/other") and not b.serves("SmolLM2")
    assert not b.serves("SmolLM2-135M/extra")


def test_help_lists_commands_in_the_readmes_order():
    text = build_parser().format_help()
    commands = re.findall(r"^    (\S+)", text, re.M)
    assert commands[:3] == ["up", "serve", "router"], commands
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^kvpush (up|serve) ", readme, re.M)  # the first command line
    assert first is not None and first.group(1) == "up"
