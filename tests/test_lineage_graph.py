"""The lineage picture stays readable where the UI shows it: the whole tiny-cpu pipeline (37 steps,
6 stages) scaled to the page's width, every step name and key big enough and inside its box."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.lineage_graph import DISPLAY_WIDTH_PX, NAME_PT, draw_lineage, render_lineage, text_px

MIN_NAME_PX, MIN_KEY_PX, MIN_TEXT_PX = 12.0, 11.0, 9.5


@pytest.fixture(scope="module")
def lineage(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    """Manifests shaped like a full pipeline run's, from the real graph; keys and runs made up."""
    from lmforge.config import load_config
    from lmforge.engine.executor import graph
    from lmforge.hashing import digest

    config = load_config("tiny-cpu", [], str(tmp_path_factory.mktemp("ws")), check_paths=False)
    manifests: dict[str, dict] = {}
    for step in graph().active(config, config.stages):
        key = digest(step.name, length=16)
        manifests[step.name] = {
            "stage": step.stage,
            "key": key,
            "dir": f"/ws/{step.name}/{key}",
            "inputs": {u: {"key": manifests[u]["key"]} for u in graph().upstream(step, config)},
            "extra": {},
        }
    manifests["serve/release"]["extra"] = {"served_name": "lmforge-0123456789ab", "url": "http://127.0.0.1:8000"}
    status = {n: "computed" if i % 3 else "cached" for i, n in enumerate(manifests)}
    computed_by = {
        n: "outside Prefect (--local), host ci" if i < 11 else "run tiny-cpu (brave-otter), host ci"
        for i, n in enumerate(manifests)
    }
    return manifests, status, computed_by


def test_every_step_name_and_key_is_readable_at_the_pages_width(lineage: tuple[dict, dict, dict]) -> None:
    import matplotlib.pyplot as plt

    manifests = lineage[0]
    assert len(manifests) == 37 and len({m["stage"] for m in manifests.values()}) == 6
    fig = draw_lineage(*lineage)
    try:
        fig.set_dpi(DISPLAY_WIDTH_PX / fig.get_figwidth())  # one figure pixel = one pixel on the page
        fig.canvas.draw()
        by_gid = {a.get_gid(): a for a in fig.findobj() if a.get_gid()}
        texts = [t for t in fig.findobj(plt.Text) if t.get_text()]
        px = {id(t): t.get_fontsize() * fig.dpi / 72 for t in texts}
        for name in manifests:
            box = by_gid[f"box:{name}"].get_window_extent()
            for kind, least in (("name", MIN_NAME_PX), ("key", MIN_KEY_PX)):
                text = by_gid[f"{kind}:{name}"]
                assert px[id(text)] >= least, (name, kind, px[id(text)])
                extent = text.get_window_extent()
                assert box.x0 < extent.x0 and extent.x1 < box.x1 and box.y0 < extent.y0 and extent.y1 < box.y1, (
                    name,
                    kind,
                )
        width, height = fig.canvas.get_width_height()
        for text in texts:
            assert px[id(text)] >= MIN_TEXT_PX, text.get_text()
            extent = text.get_window_extent()
            assert extent.x0 >= 0 and extent.x1 <= width and extent.y0 >= 0 and extent.y1 <= height, text.get_text()
        assert text_px(NAME_PT, fig.get_figwidth()) == pytest.approx(px[id(by_gid["name:curate/ingest"])])
        assert {t.get_text() for t in texts} >= {"curate", "pretrain", "align", "evaluate", "quantize", "serve"}
    finally:
        plt.close(fig)


def test_the_png_is_never_upscaled_by_the_page(lineage: tuple[dict, dict, dict], tmp_path: Path) -> None:
    from PIL import Image

    png = render_lineage(*lineage, tmp_path / "lineage.png")
    width, height = Image.open(png).size
    assert DISPLAY_WIDTH_PX <= width <= 2 * DISPLAY_WIDTH_PX and height > width / 2
