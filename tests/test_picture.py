"""The picture of a step's memory (issue 41): the figures drawn are the plan's own (the peak
marked is ``estimated_peak``, the budget line sits at the budget, the recomputes named are
the plan's entries), the drawing code keeps peaks and stays light, and ``--plot`` writes a
page for ``plan`` and ``fit``."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import autoremat
from autoremat.cli import main
from autoremat.cli.targets import load_target
from autoremat.examples import gpt2, mlp
from autoremat.picture.browser import page_messages
from autoremat.picture.draw import fit_bars
from autoremat.picture.fit_figure import Bar, fit_svg
from autoremat.picture.series import aligned, decimated, spans
from autoremat.picture.step_figure import Curve, Span, StepFigure, frame_of, step_svg
from autoremat.picture.svg import size_ticks
from autoremat.training.scale_batch import scale_batch
from autoremat.wrap.checkpointed import wrapped_paths
from conftest import TINY


def peaks(html: str) -> dict[str, int]:
    """Each curve's peak as its marker says (``data-peak``)."""
    return {c: int(p) for p, c in re.findall(r'data-peak="(\d+)" data-curve="(\w+)"', html)}


def recomputes(html: str) -> dict[str, set[str]]:
    """The entries shaded as recomputed, with the ways they are marked."""
    found: dict[str, set[str]] = {}
    for entry, way in re.findall(r'data-entry="([^"]*)" data-way="([^"]*)"', html):
        found.setdefault(entry, set()).add(way)
    return found


@pytest.fixture(scope="module")
def gpt2_page(tmp_path_factory):
    model, args, kwargs = gpt2()
    plan = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    path = tmp_path_factory.mktemp("picture") / "gpt2.html"
    autoremat.plot(plan, path, model, args, kwargs)
    return plan, path.read_text()


@pytest.mark.slow
def test_the_peaks_marked_are_the_plans_own(gpt2_page):
    plan, html = gpt2_page
    assert peaks(html) == {"plan": plan.estimated_peak, "without": plan.baseline_peak}
    assert f"peak {plan.estimated_peak / 2**20:.3g} MiB" in html
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no network
    assert "<script" not in html


@pytest.mark.slow
def test_the_budget_line_sits_at_the_budget(gpt2_page):
    plan, html = gpt2_page
    y_max = float(re.search(r'data-y-max="([\d.e+]+)"', html).group(1))
    line = re.search(r'<line [^>]*y1="([\d.]+)"[^>]*data-budget="(\d+)"', html)
    assert int(line.group(2)) == plan.budget
    frame = frame_of(StepFigure((), 1.0, budget=plan.budget))
    expected = frame.top + frame.height * (1 - plan.budget / y_max)
    assert abs(float(line.group(1)) - expected) < 0.06


@pytest.mark.slow
def test_the_recomputes_named_are_the_plans_entries(gpt2_page):
    plan, html = gpt2_page
    shaded = recomputes(html)
    assert set(shaded) == set(plan.modules)
    assert {e for e, ways in shaded.items() if ways != {"full"}} == set(plan.selective)


def test_a_selective_recompute_is_hatched_and_named():
    figure = StepFigure(
        (Curve("plan", "with the plan", "plan", (0.0, 1.0, 2.0, 3.0), (5, 90, 40, 10)),),
        4.0,
        recomputes=(Span(0, 2, "h.0.mlp", "selective"), Span(2, 3, "h.1", "full")),
        budget=100,
    )
    svg = step_svg(figure)
    assert recomputes(svg) == {"h.0.mlp": {"selective"}, "h.1": {"full"}}
    assert "url(#selective)" in svg and "h.0.mlp (sel.)" in svg
    assert "recompute of h.0.mlp (selective)" in svg  # its <title>, on hover


def test_thousands_of_moments_make_a_small_page_that_keeps_the_peak():
    n = 60_000
    highs = tuple((k * 7919) % 1_000_003 for k in range(n))
    curve = Curve("plan", "with the plan", "plan", tuple(map(float, range(n))), highs)
    svg = step_svg(StepFigure((curve,), float(n), budget=900_000))
    assert len(svg) < 200_000
    assert peaks(svg) == {"plan": max(highs)}


@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=3000), st.integers(1, 200))
def test_decimation_keeps_the_highest_and_lowest_and_few_points(ys, columns):
    xs = [float(k) for k in range(len(ys))]
    points = decimated(xs, ys, columns)
    assert len(points) <= max(2 * columns, len(ys)) and len(points) <= 2 * columns + len(ys)
    assert len(points) <= 2 * columns or len(ys) <= 2 * columns
    assert max(y for _, y in points) == max(ys) and min(y for _, y in points) == min(ys)
    assert [x for x, _ in points] == sorted(x for x, _ in points)


@given(st.lists(st.integers(0, 50), min_size=3, max_size=3),
       st.lists(st.integers(1, 50), min_size=3, max_size=3))  # fmt: skip
def test_alignment_puts_each_phase_on_its_span(lengths, onto):
    xs = aligned(lengths, onto)
    assert len(xs) == sum(lengths)
    start = 0
    for k in range(len(lengths)):
        part = xs[sum(lengths[:k]) : sum(lengths[: k + 1])]
        assert all(start <= x < start + onto[k] for x in part)
        start += onto[k]


def test_spans_are_runs_of_a_label():
    assert spans(["", "a", "a", "b", "", "a"]) == [(1, 3, "a"), (3, 4, "b"), (5, 6, "a")]


@given(st.integers(1024, 2**45))
def test_size_ticks_are_round_and_cover_the_axis(y_max):
    ticks = size_ticks(y_max)
    assert ticks[0] == (0, "0") and 3 <= len(ticks) <= 12
    assert all(a[0] < b[0] <= y_max * (1 + 1e-9) for a, b in itertools.pairwise(ticks))
    assert all(re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", label) for _, label in ticks[1:])


def test_the_page_s_own_messages_are_told_from_chromium_s_noise():
    url = "file:///tmp/x/step.html"
    log = "\n".join([
        "[1:2:ERROR:dbus/bus.cc:405] Failed to connect to the bus: no socket",
        "[1:2:WARNING:media/gpu/vaapi/vaapi_wrapper.cc:1655] drmGetDevices2() found none",
        f'[1:2:INFO:CONSOLE:1] "boom", source: {url} (1)',
        "[1:2:INFO:CONSOLE:3] \"other\", source: file:///elsewhere.html (3)",
    ])  # fmt: skip
    assert page_messages(log, url) == (f'[1:2:INFO:CONSOLE:1] "boom", source: {url} (1)',)


def test_fit_bars_add_up_to_the_device_bytes_and_mark_the_choice():
    bars = [
        Bar(8, (("parameters and buffers", 100), ("activations", 300)), note="its plan"),
        Bar(16, (("parameters and buffers", 100), ("activations", 500)), chosen=True),
    ]
    svg = fit_svg(bars, 700)
    assert 'data-chosen="16"' in svg and 'data-device="700"' in svg
    assert re.findall(r'data-part="activations" data-bytes="(\d+)"', svg) == ["300", "500"]


def test_plot_names_what_it_needs():
    model, args, kwargs = mlp()
    plan = autoremat.Plan(modules=(), strategy="budget", model_class="MLP")
    with pytest.raises(TypeError, match="needs the model and inputs"):
        autoremat.plot(plan, "x.html")
    with pytest.raises(TypeError, match="a Plan or a Fit"):
        autoremat.plot("plan", "x.html")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        autoremat.plot(plan, "/no/such/folder/x.html", model, args, kwargs)


def test_plot_draws_a_plan_already_applied_and_leaves_it_applied(tmp_path):
    model, args, kwargs = mlp()
    plan = autoremat.plan(model, args, kwargs, budget="60%", objective="flops")
    assert plan.modules
    unwrapped = tmp_path / "unwrapped.html"
    autoremat.plot(plan, unwrapped, model, args, kwargs)
    plan.apply(model)
    applied = tmp_path / "applied.html"
    autoremat.plot(plan, applied, model, args, kwargs)
    assert peaks(applied.read_text()) == peaks(unwrapped.read_text())
    assert peaks(applied.read_text())["without"] == plan.baseline_peak
    assert set(wrapped_paths(model)) == set(plan.modules)
    other = autoremat.Plan(modules=(), strategy="budget", model_class="MLP")
    with pytest.raises(ValueError, match=r"not this plan's.*autoremat\.remove"):
        autoremat.plot(other, tmp_path / "other.html", model, args, kwargs)
    assert set(wrapped_paths(model)) == set(plan.modules)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_cli_plan_plot_writes_the_page(tiny, tmp_path, capsys, dtype):
    out = tmp_path / "step.html"
    argv = ["plan", tiny, "--budget", "80%", "--plot", str(out), "--measure"]
    assert main(argv + (["--autocast", dtype] if dtype else [])) == 0
    html = out.read_text()
    assert f"picture: {out}" in capsys.readouterr().out
    assert set(peaks(html)) == {"plan", "without", "measured"}
    assert recomputes(html)


@pytest.mark.parametrize(
    "command", [["plan", "--budget", "80%"], ["fit", "--device-memory", "4MiB"]]
)
def test_cli_refuses_a_page_it_cannot_write_before_planning(tiny, capsys, command):
    argv = [command[0], tiny, *command[1:], "--plot", "/no/such/folder/x.html"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "the folder /no/such/folder does not exist" in captured.err
    assert captured.out == ""  # (nothing planned first)


def test_a_bf16_page_says_so(tiny, tmp_path):
    model, args, kwargs = load_target(tiny)
    plan = autoremat.plan(model, args, kwargs, budget="80%", autocast=torch.bfloat16)
    html = autoremat.plot(plan, tmp_path / "p.html", model, args, kwargs,
                          autocast=torch.bfloat16).read_text()  # fmt: skip
    assert "under bfloat16 autocast" in html


@pytest.fixture(scope="module")
def tiny_fit(tmp_path_factory):
    file = tmp_path_factory.mktemp("fit") / "tiny.py"
    file.write_text(TINY)
    model, args, kwargs = load_target(f"{file}:build")
    found = autoremat.fit(model, lambda b: scale_batch(args, kwargs, b), device_memory="4MiB",
                          verify=False, max_batch=4096)  # fmt: skip
    return found, f"{file}:build"


@pytest.mark.slow
def test_cli_fit_plot_draws_each_batch_tried(tiny_fit, tmp_path, capsys):
    out = tmp_path / "fit.html"
    argv = ["fit", tiny_fit[1], "--device-memory", "4MiB", "--no-verify", "--max-batch", "4096"]
    assert main([*argv, "--plot", str(out)]) == 0
    html = out.read_text()
    assert len(re.findall(r"data-chosen=", html)) == 1
    assert f'data-device="{4 * 2**20}"' in html
    assert len(set(re.findall(r'data-batch="(\d+)"', html))) >= 2


@pytest.mark.slow
def test_fit_bars_are_the_whole_step_of_each_batch(tiny_fit):
    found = tiny_fit[0]
    bars = fit_bars(found)
    chosen = [b for b in bars if b.chosen]
    assert [b.batch for b in chosen] == [found.batch]
    assert chosen[0].total == found.chosen.memory.device + found.device.reserve
    assert {b.batch for b in bars} >= {b for b, _ in found.tried} and len(found.tried) >= 2
