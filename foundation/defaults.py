"""Defaults that the app, the engine and the CLI share, each written once (import it, never retype it).

``app.settings`` takes its field defaults from here, the engine's constructors and functions take their
keyword defaults from here, and the CLI's options theirs; ``dmlsearch serve`` then shows the settings'
defaults in its help. Index options (type, memory budget, target recall) live on ``index.selection``'s
``IndexOptions`` instead: the index package sits below the engine and may not import it.
"""

from __future__ import annotations

import os
from pathlib import Path

# Where `dmlsearch export` writes the pretrained model and where `serve` looks for the model and index.
MODEL_PATH = Path("artifacts/model/model.onnx")
INDEX_PATH = Path("artifacts/index")
# `dmlsearch demo` (`make demo`) keeps its model, gallery and index here: never in the two paths above,
# which hold the user's own model and index.
DEMO_DIR = Path("artifacts/demo")

# Where applying a duplicates plan moves the images it sets aside: a folder inside the gallery (same file
# system, so a move is a rename), never listed as part of the gallery.
TRASH_FOLDER = ".dmlsearch-trash"
# The mark of a gallery folder (a random id, written once): an index whose vectors several processes share
# (a Milvus collection) records it, and a process writes photos only into a folder that carries it.
GALLERY_MARK = ".dmlsearch-gallery"
# The duplicate review's keeper rule (engine.gallery.keeper): the keys that find a group's source, in
# the order they break ties; the CLI's --keep-by default.
KEEPER_RULE = ("camera", "source", "date", "folder", "centre", "file-time")
# The similar tier (engine.duplicates.tiers): images at this cosine or closer are the same scene (a second
# take, a copy). Another photo of the same car model is about as close to the embedding as a second take.
SIMILAR_COSINE = 0.86
# Seconds a call to the index server (Milvus) may take, retries and reconnecting included, and the most a
# request's calls take in all in the API: a server that is down, stuck or restarting fails requests, never
# hangs them.
INDEX_DEADLINE_SECONDS = 10.0
# Refuse images with more pixels (about 7,000 x 7,000) before decoding them.
MAX_IMAGE_PIXELS = 50_000_000
# Refuse requests whose images decode to more pixels in all: two images at the limit. A batch of 64 phone
# JPEGs (12 MP, decoded at 1/4 scale by the JPEG draft) takes ~48 MP; eight blank 49-MP PNGs (392 MP,
# seconds of decoding from a 372 KB request) are refused before any is decoded.
MAX_BATCH_PIXELS = 100_000_000
# What decoding one image may cost (engine.decode.pool): CPU seconds, wall-clock seconds (on a CPU shared
# with other requests) and memory above a decode process's own. Past any of them the image is refused,
# 422 image_too_costly; the figures behind each: README, "Limits and memory".
DECODE_CPU_SECONDS = 5.0
DECODE_WALL_SECONDS = 30.0
DECODE_MEMORY_BYTES = 1024 * 1024**2
# What decoding all the images of one request may cost together (a batch, a search with its examples):
# CPU seconds and wall-clock seconds. Past either the request is cut off at the image that ran out, 422
# request_too_costly: a batch of 64 images each just under the limits above would otherwise hold a decode
# process for 64 x 5 s of CPU. 15 s is three images at the CPU limit, and some 100 phone photos' decode
# (64 is the largest batch).
DECODE_REQUEST_CPU_SECONDS = 15.0
DECODE_REQUEST_WALL_SECONDS = 60.0
# Seconds a query holds its compute slot while another client waits before it goes on in the background,
# its decodes at the lowest CPU priority (app.compute): a normal search's decode and model run take a
# fraction of it, a costly decode holds the slot no longer.
COMPUTE_QUANTUM_SECONDS = 0.5
# How wide a network of client addresses counts as one client (app.clients), in prefix bits: one IPv4
# address; an IPv6 /64, the least a host or a home is given (RFC 6177), so its 2**64 addresses are one.
CLIENT_IPV4_PREFIX = 32
CLIENT_IPV6_PREFIX = 64
# Wall-clock seconds one model run (at most RUN_IMAGES images, already resized to the model's input) may
# take in the server before onnxruntime is told to stop it: minutes of a loaded CPU, never a normal run.
EMBED_RUN_SECONDS = 60.0
# The most bytes read of a file we read whole (foundation.regular_files): an index's manifest.json and a
# model's card (model.json) are about 1 KB, so 1 MiB is a damaged or a wrong file; a duplicates plan lists
# every member of every group (~200 bytes each), 64 MiB some 300,000; an image file, the query of
# `dmlsearch query`/`explain` or a gallery image served, holds at most MAX_IMAGE_PIXELS of 4 channels of
# 16 bits uncompressed (400 MB) and its header.
MANIFEST_BYTES = 1024**2
MODEL_CARD_BYTES = 1024**2
PLAN_BYTES = 64 * 1024**2
IMAGE_FILE_BYTES = 512 * 1024**2
# Decode large JPEGs at reduced DCT scale (see engine.decode.images.DRAFT_MARGIN for the measured cost).
JPEG_DRAFT = True

# A query box (search by a region) must be at least this many pixels wide and high in the upright image:
# the model resizes the region to its 224-px input, and a smaller one is upsampled 14x and more into blur.
MIN_BOX_SIDE = 16

# The peaks of a why-it-matched explanation (engine.serve.explain.matched_windows): squares of this many x
# this many grid positions, one in each image, that show the same thing most specifically. One
# position of Lite0's 7 x 7 grid is a 32-px cell whose features see far beyond it: 3 x 3 windows (96 px of
# the 224-px view) put the peak inside a pasted 56-96 px object far more often than one position or 2 x 2
# (bench/results/explain_pointing.md).
EXPLAIN_PEAK_POSITIONS = 3

# Results per query, the most a client may ask for, and the cosine cut that keeps everything.
TOP_K = 10
MAX_K = 1000
MIN_SCORE = -1.0
# rerank=pddm re-scores the top max(RERANK_POOL, engine.serve.ranking.RERANK_POOL_FACTOR x k) cosine
# neighbours.
RERANK_POOL = 100
# A search refined by examples (engine.serve.refine): at most this many positive and negative examples in
# all, ids and uploaded images together (each uploaded one is decoded and embedded with the query; a
# results page of the UI shows at most 48), and how they combine unless told (Qdrant's default too).
MAX_EXAMPLES = 64
REFINE_STRATEGY = "average_vector"
# sigma^2 of the predict=true vote: each neighbour weighs exp(-|q - x|^2 / 2 sigma^2) (engine.serve.voting).
VOTE_SIGMA2 = 0.05

# The pretrained backbone a model is exported or trained from unless another is named (training.backbone).
BACKBONE = "efficientnet_lite0"
# Longest side of the thumbnails the UI shows and the API makes unless told another size.
THUMBNAIL_SIZE = 256

# Images embedded per model call when indexing a folder.
BATCH_SIZE = 32
# Threads decoding and preprocessing images while the model embeds (engine.build.prefetch); why two:
# bench/results/build_speed.md.
DECODE_WORKERS = 2
# Progress written to a file or a pipe (foundation.progress): a plain line every this many percent, and at
# least every this many seconds while work moves, instead of a bar redrawn with carriage returns.
PROGRESS_LINE_PERCENT = 10
PROGRESS_LINE_SECONDS = 10.0
# Images that calibrate an int8 export's activation ranges (training.quantize; bench/int8_variants.py).
CALIBRATION_IMAGES = 300

# Where the benchmarks keep extracted features and their training runs: $XDG_CACHE_HOME/dmlsearch, by
# default ~/.cache/dmlsearch (outside the repository, shared by every checkout on the machine).
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dmlsearch"

# Where `dmlsearch serve` listens and `dmlsearch ui` (and the Streamlit page) finds it.
API_HOST = "127.0.0.1"
API_PORT = 8000
API_URL = f"http://{API_HOST}:{API_PORT}"
UI_PORT = 8501
