"""Attacking ``/v1/explain`` with a model that has an explainer (issue 43): costly inputs of other kinds.

    python bench/hostile_explain.py  # writes bench/results/hostile_explain.json and .md

The pretrained EfficientNet-Lite0 exported with its explainer (``--model`` takes another explainable
model), a small gallery with one costly file, ``dmlsearch serve`` with its defaults under a 3 GB
address-space cap (127.0.0.1 a trusted proxy, no rate limit). Each hostile client, from its own address,
asks for explanations again and again for ``--seconds`` while a normal client searches:
- ``16-bit gradient``: a 7000x7000 16-bit greyscale PNG of a gradient (49 MP, a few hundred KB: cheap to
  send, the whole frame decoded and converted);
- ``LZW TIFF``: 7000x7000 RGB stripes in an LZW TIFF (49 MP, 147 MB decoded from a small file);
- ``lossless WebP``: 16383x3000 RGBA stripes in a lossless WebP (49 MP, 197 MB decoded);
- ``new boxes``: ``GET /v1/explain`` of the costly gallery file against itself with a ``box`` never asked
  before, so that no cached result helps;
- ``wide strip``: a 50,000,000x1 PNG (an aspect ratio that a resize to the model's square must not inflate).
Reported: the normal searches' median and slowest time against the usual ones, what each hostile client
got, the server's peak resident memory, and the load average before and after.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
from hostile_budget import NORMAL_ADDRESS, load, normal_search, summary
from hostile_fairness import Send, attack, queued_line
from lib.hostile_images import jpeg_repeated_scan
from lib.images import image_bytes, make_image, write_labelled_folder
from lib.options import bench_parser, out_option
from lib.servers import ServerProcess, reset_peak, serving
from PIL import Image, ImageDraw


def gradient_png_16bit(side: int = 7000) -> bytes:
    ramp = np.linspace(0, 65535, side, dtype=np.uint16)
    pixels = np.add.outer(ramp // 2, ramp // 2).astype(np.uint16)
    return image_bytes(Image.fromarray(pixels), "PNG")


def stripes(size: tuple[int, int], mode: str) -> Image.Image:
    """Bands of colour, a line in every 64: a file of a few hundred KB decodes to the whole frame."""
    image = Image.new(mode, size, (40, 90, 160, 255)[: len(mode)])
    draw = ImageDraw.Draw(image)
    for y in range(0, size[1], 64):
        draw.line([(0, y), (size[0], y)], fill=(250, 200, 10, 255)[: len(mode)], width=3)
    return image


def striped_tiff_lzw(side: int = 7000) -> bytes:
    out = io.BytesIO()
    stripes((side, side), "RGB").save(out, "TIFF", compression="tiff_lzw")
    return out.getvalue()


def lossless_webp(width: int = 16383, height: int = 3000) -> bytes:
    out = io.BytesIO()
    stripes((width, height), "RGBA").save(out, "WEBP", lossless=True, quality=50, method=1)
    return out.getvalue()


def wide_strip(width: int = 50_000_000) -> bytes:
    return image_bytes(Image.new("L", (width, 1), 128), "PNG")


def attackers(server: ServerProcess, costly_item: int, normal_item: int) -> dict[str, Send]:
    boxes = itertools.count(1)

    def upload(data: bytes, name: str) -> Send:
        def send(client: httpx.Client, address: str) -> httpx.Response:
            return client.post(
                f"{server.url}/v1/explain",
                params={"item": normal_item},
                files=[("image", (name, data))],
                headers={"X-Forwarded-For": address},
            )

        return send

    def new_boxes(client: httpx.Client, address: str) -> httpx.Response:
        step = next(boxes)
        x0, y0 = (step % 97) / 200, (step // 97 % 97) / 200
        params = {"item": costly_item, "query_item": costly_item, "box": f"{x0:.4f},{y0:.4f},0.9,0.9"}
        return client.get(f"{server.url}/v1/explain", params=params, headers={"X-Forwarded-For": address})

    return {
        "16-bit gradient": upload(gradient_png_16bit(), "gradient.png"),
        "LZW TIFF": upload(striped_tiff_lzw(), "stripes.tif"),
        "lossless WebP": upload(lossless_webp(), "bands.webp"),
        "new boxes": new_boxes,
        "wide strip": upload(wide_strip(), "strip.png"),
    }


def export_explainable(folder: Path) -> Path:
    from training.backbone import BACKBONES, create_backbone
    from training.export import export_onnx
    from training.model import EmbeddingModel

    model = folder / "model.onnx"
    backbone = "efficientnet_lite0"
    export_onnx(
        EmbeddingModel(create_backbone(backbone)),
        model,
        preprocessing=BACKBONES[backbone].preprocessing,
        backbone=backbone,
    )
    return model


def markdown(result: dict) -> str:
    usual, row = result["usual"], result["attack"]
    lines = [
        "# Attacking /v1/explain with an explainable model (issue 43)",
        "",
        f"`python bench/hostile_explain.py {' '.join(result['argv'])}`; {result['cores']} cores, shared; "
        f"{len(row['hostile'])} hostile clients, each from its own address, for {result['seconds']} s; the "
        f"server's defaults otherwise (rate limit off), under a 3 GB address-space cap.",
        "",
        f"Usual time (alone, {usual['count']} searches): median {usual['median_s']} s, slowest "
        f"{usual['max_s']} s; load average {result['usual_load']}.",
        "",
        f"Beside the attack ({row['normal']['count']} searches): median {row['normal']['median_s']} s, "
        f"slowest {row['normal']['max_s']} s ({row['normal']['max_s'] - usual['max_s']:+.3f} s against the "
        f"usual slowest; {queued_line(row)}); load average {row['load_before']} before, {row['load_after']} "
        f"after. Not answered 200: {', '.join(row['normal_refused']) or 'none'}; /healthz after: "
        f"{row['healthz_after']}. Server resident memory {row['rss_before_mb']} MB before, peak "
        f"{row['peak_rss_mb']} MB during the attack.",
        "",
        "| hostile client | request bytes | answers | its slowest s |",
        "|---|---|---|---|",
    ]
    for name, tally in row["hostile"].items():
        answers = ", ".join(f"{count} x {status}" for status, count in sorted(tally["answers"].items()))
        lines.append(f"| {name} | {result['sizes'].get(name, '')} | {answers} | {tally['slowest_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/hostile_explain.json")))
    parser.add_argument("--model", type=Path, help="an explainable model.onnx (default: exported here)")
    parser.add_argument("--address-space", type=int, default=3_000_000_000)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the hostile clients go on")
    parser.add_argument("--gallery-scans", type=int, default=40)
    parser.add_argument("--normal", type=int, default=10, help="normal searches alone, for the usual time")
    args = parser.parse_args()
    query = image_bytes(make_image(3, (640, 480)), "JPEG", quality=90)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        gallery = write_labelled_folder(work / "gallery", classes=4, per_class=4)
        (gallery / "class_00" / "costly.jpg").write_bytes(jpeg_repeated_scan(args.gallery_scans))
        model = args.model or export_explainable(work / "model")
        build = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--model", str(model)]
        built = subprocess.run(
            [*build, "--out", str(work / "index")], check=True, capture_output=True, text=True
        )
        serve = ["--index", str(work / "index"), "--model", str(model), "--rate-limit", "0"]
        serve += ["--trusted-proxy", "127.0.0.1"]
        with serving(serve, address_space=args.address_space, log=work / "server.log") as server:
            items = httpx.get(f"{server.url}/v1/items", params={"limit": 1000}).json()["items"]
            costly = next((item["id"] for item in items if item["path"].endswith("costly.jpg")), None)
            if costly is None:
                raise RuntimeError(f"build-index did not index costly.jpg:\n{built.stdout}{built.stderr}")
            normal_item = next(item["id"] for item in items if not item["path"].endswith("costly.jpg"))
            for _ in range(3):  # warm-up
                normal_search(server, query)
            usual_load = load()
            usual = summary([normal_search(server, query) for _ in range(args.normal)])
            sends = attackers(server, costly, normal_item)
            rss_before = reset_peak(server)
            row = attack(server, sends, args.seconds, query)
            row["rss_before_mb"] = round(rss_before / 1024**2)
            row["peak_rss_mb"] = round(server.status("VmHWM") / 1024**2)
            alive = httpx.get(f"{server.url}/healthz", headers={"X-Forwarded-For": NORMAL_ADDRESS})
            row["healthz_after"] = alive.status_code
    result = {
        "argv": sys.argv[1:],
        "cores": len(os.sched_getaffinity(0)),
        "seconds": args.seconds,
        "usual": usual,
        "usual_load": usual_load,
        "sizes": {
            "16-bit gradient": len(gradient_png_16bit()),
            "LZW TIFF": len(striped_tiff_lzw()),
            "lossless WebP": len(lossless_webp()),
            "wide strip": len(wide_strip()),
        },
        "attack": row,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
