"""``python -m atomd_bench --help`` names every benchmark and how long it takes."""

from __future__ import annotations

import pytest

from atomd_bench.__main__ import BENCHES, WITH_OPTIONS, main


def test_help_lists_every_benchmark_with_its_duration(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    for name, b in BENCHES.items():
        assert any(line.split()[:1] == [name] and b.takes in line for line in out.splitlines()), (
            name
        )
    for name in WITH_OPTIONS:
        assert f"python -m atomd_bench {name} --help" in out


def test_an_unknown_name_is_refused_with_the_list() -> None:
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert "unknown benchmark(s) ['nope']" in str(e.value) and "train_tiny" in str(e.value)
