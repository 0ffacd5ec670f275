"""`bench pd ab`'s report: the share of long prompts per run, the plot of the short chats' TPOT p99 against it, and
the rates it takes."""

from __future__ import annotations

import pytest

from mlc.bench.pd import LoadReport, ab_plot, long_share


def report(layout: str, rate: float, longs: int, p99: float) -> LoadReport:
    return LoadReport(layout, rate, 60, longs, 0, p99 / 2, p99, 80.0, 200.0, 900.0, 50.0)


def test_the_plot_has_a_line_per_layout_against_the_long_share(tmp_path):
    reports = [report(layout, rate, longs, p99) for layout, points in (
        ("colocated", ((0.0, 0, 40.0), (0.1, 6, 95.0), (0.2, 12, 160.0))),
        ("1P+1D", ((0.0, 0, 42.0), (0.1, 6, 47.0), (0.2, 12, 51.0)))) for rate, longs, p99 in points]
    assert long_share(reports[1]) == pytest.approx(6 / 66)
    path = ab_plot(reports, tmp_path / "ab.png", "title")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("rates, message", [("fast", "give prompts per second"), ("0,0.1", "above 0")])
def test_bad_long_rates_are_refused_before_anything_starts(rates, message, capsys):
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "pd", "ab", "--long-rate", rates])
    err = capsys.readouterr().err
    assert exited.value.code != 0 and message in err and "Traceback" not in err
