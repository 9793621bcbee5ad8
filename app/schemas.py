"""Request and response bodies of the HTTP API (the OpenAPI contract)."""

from __future__ import annotations

import base64
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from engine.gallery.labels import LABEL_PATTERN, MAX_LABEL_CHARS
from engine.model.model_card import ValidationCheck
from engine.serve.explain import Heatmap
from engine.serve.query import BatchResponse
from engine.serve.ranking import QueryHits
from engine.serve.voting import Prediction
from foundation import defaults
from foundation.names import readable_name
from index.judgments import Judgment
from index.protocol import Item

# Every image the API sends: browsers must not sniff another type out of a gallery file's bytes.
IMAGE_HEADERS = {"X-Content-Type-Options": "nosniff"}


# An image as base64 text (checked and decoded by app.uploads, which also takes a data: URL prefix). The
# pattern is strict base64 as app.uploads decodes it (ASCII, padded, not empty): the schema says so
# itself, where text outside it is 400 invalid_base64 (and an empty image 400 empty_image).
_BASE64 = "[A-Za-z0-9+/]"
BASE64_PATTERN = (
    f"^(data:[A-Za-z0-9_/+.-]*;base64,)?({_BASE64}{{4}})*({_BASE64}{{4}}|{_BASE64}{{2}}==|{_BASE64}{{3}}=)$"
)
Base64Image = Annotated[
    str, Field(json_schema_extra={"contentEncoding": "base64", "pattern": BASE64_PATTERN})
]
# A gallery path as a response shows it: a name that is not UTF-8 with backslash escapes (foundation.names).
ShownPath = Annotated[str, BeforeValidator(readable_name)]


class ResultOut(BaseModel):
    id: int
    path: ShownPath
    label: str | None
    score: float = Field(
        description="cosine similarity to the query, in [-1, 1]; refined by examples, the strategy's score: "
        "average_vector's cosine to the refined query, best_score's best cosine to a positive example (the "
        "query included), or minus the square of its best cosine to a negative one where that is higher"
    )
    rank: int = Field(description="1-based position among all results (paging keeps ranks global)")
    pddm_score: float | None = Field(
        None,
        description="with rerank=pddm: the PDDM unit's learned similarity S(query, item), which orders the "
        "results (higher = more similar; unbounded, not comparable across models); null otherwise",
    )


class PredictionOut(BaseModel):
    label: str
    confidence: float = Field(description="the label's share of the neighbours' softmax weight")
    votes: dict[str, float]

    @classmethod
    def of(cls, prediction: Prediction | None) -> PredictionOut | None:
        return None if prediction is None else cls(**vars(prediction))


class SearchOut(BaseModel):
    results: list[ResultOut]
    prediction: PredictionOut | None = None
    took_ms: float
    timings_ms: dict[str, float] = Field(description="milliseconds per stage of this query")
    model_fingerprint: str

    @classmethod
    def of(cls, response: BatchResponse, before_ms: dict[str, float]) -> SearchOut:
        """The answer to a one-query search; ``before_ms``: the stages before the engine's (receiving the
        upload, waiting for a slot)."""
        (hits,) = response.queries
        return cls(
            results=[ResultOut(**vars(result)) for result in hits.results],
            prediction=PredictionOut.of(hits.prediction),
            took_ms=response.took_ms + sum(before_ms.values()),
            timings_ms={**before_ms, **response.timings_ms},
            model_fingerprint=response.model_fingerprint,
        )


class QueryOut(BaseModel):
    results: list[ResultOut]
    prediction: PredictionOut | None = None

    @classmethod
    def of(cls, hits: QueryHits) -> QueryOut:
        return cls(
            results=[ResultOut(**vars(result)) for result in hits.results],
            prediction=PredictionOut.of(hits.prediction),
        )


class BatchSearchOut(BaseModel):
    queries: list[QueryOut] = Field(description="one entry per uploaded image, in upload order")
    took_ms: float
    timings_ms: dict[str, float]
    model_fingerprint: str

    @classmethod
    def of(cls, response: BatchResponse, before_ms: dict[str, float]) -> BatchSearchOut:
        return cls(
            queries=[QueryOut.of(hits) for hits in response.queries],
            took_ms=response.took_ms + sum(before_ms.values()),
            timings_ms={**before_ms, **response.timings_ms},
            model_fingerprint=response.model_fingerprint,
        )


class ItemOut(BaseModel):
    id: int
    path: ShownPath = Field(description="relative to the gallery folder")
    label: str | None
    content_hash: str
    added: str = Field(description="when it was indexed (ISO 8601, UTC)")
    taken: str | None = Field(
        description="when the photo was taken, on the camera's clock (EXIF capture time, else the file's "
        "time; ISO 8601 with the UTC offset where known); null for items indexed before it was kept, until "
        "the next build-index"
    )

    @classmethod
    def of(cls, item: Item) -> ItemOut:
        return cls(
            id=item.id,
            path=item.path,
            label=item.label,
            content_hash=item.content_hash,
            added=item.added,
            taken=item.taken,
        )


TierName = Literal["exact", "edited", "similar"]
ActionName = Literal["keep", "set_aside"]


class EvidenceOut(BaseModel):
    """Why an item is in its group: its strongest pair."""

    pairs_with: int = Field(description="the id of the item it pairs with")
    tier: TierName = Field(description="the pair's tier")
    signature_bits: int | None = Field(description="perceptual-signature distance (null: no signature)")
    cosine: float
    hash: str | None = Field(description="the content hash (sha256:) or pixel digest (pixels:) both share")
    alignment: float | None = Field(
        None,
        description="the aligned check's NCC of both thumbnails, 1 where one image is a window of the other "
        "(an off-centre crop; null: not checked)",
    )


class ReviewOut(BaseModel):
    """What the keeper rule compares, and its proposal."""

    content_hash: str
    pixels: int = Field(description="width x height (0: the file cannot be read)")
    width: int = Field(0, description="0: the file cannot be read")
    height: int = Field(0, description="0: the file cannot be read")
    bytes: int = Field(description="file size (0: the file cannot be read)")
    camera: str | None = Field(None, description="the camera's make and model from the file's EXIF")
    date: str = Field(
        description="when the photo was taken: the camera's clock (EXIF), else the file's time (dated_by)"
    )
    dated_by: str | None = Field(None, description="camera clock, file time, or index (an unreadable file)")
    action: ActionName = Field(description="the keeper rule's proposal")


class DuplicateOut(BaseModel):
    id: int = Field(description="the item's id (a byte copy's: the id of the item whose bytes it has)")
    path: ShownPath
    label: str | None
    byte_copy: bool = Field(
        False,
        description="with tier only: a file with the bytes of item `id`, which the index holds once; "
        "setting it aside moves only the file",
    )
    score: float = Field(description="the item's highest cosine similarity to another member of its group")
    evidence: EvidenceOut | None = Field(None, description="with tier only")
    review: ReviewOut | None = Field(None, description="with tier only")


class DuplicateGroupOut(BaseModel):
    size: int
    items: list[DuplicateOut]
    tier: TierName | None = Field(None, description="with tier only: the strictest tier whose pairs join it")
    reason: str | None = Field(
        None,
        description="with tier only: why the keeper rule keeps the member it keeps (a similar group: why "
        "every member is kept)",
    )


class DuplicatesOut(BaseModel):
    threshold: float = Field(description="the cosine cut used (the index's default when none was given)")
    max_distance: int = Field(description="perceptual-signature bits two copies may differ by")
    unsigned: int = Field(description="items without a perceptual signature, judged by cosine alone")
    note: str | None = Field(None, description="why some pairs were judged by cosine alone, if any were")
    criteria: str = Field(
        description="how pairs were judged, in words (signatures only where items have them)"
    )
    total: int = Field(description="groups at this threshold (pages walk through them, largest first)")
    offset: int
    groups: list[DuplicateGroupOut]
    tier: TierName | None = Field(None, description="the tier asked for (each includes the stricter ones)")
    keeper_rule: list[str] | None = Field(None, description="with tier only: the keeper rule's order")


# A gallery-relative path: not absolute, no ".." part, not inside the trash folder (ECMA and Python regex).
# [^\x00], not ".": the same in both engines (ECMA's "." stops at line breaks, Python's with re.S does not),
# and a NUL is in no file name.
# Segments "." and "" name no folder: "./.dmlsearch-trash/x" is in the trash, "./" is the gallery itself.
PLAN_PATH_PATTERN = (
    r"^(?!/)(?!(\.?/)*\.dmlsearch-trash(/|$))(?!([^\x00]*/)?\.\.(/|$))(?!(\.?/)*\.?$)[^\x00]+$"
)


def _json_number(value: object) -> object:
    """JSON's integers include 3.0 (JSON Schema's rule, which lax parsing follows), never true, false or
    a string of digits."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    return value


PlanInteger = Annotated[int, BeforeValidator(_json_number)]


PLAN_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$"  # a trash folder's name inside the gallery


class PlanMemberIn(BaseModel):
    # JSON's safe integers: a number read as a double (3.0 is an integer to JSON Schema) stays exact.
    id: PlanInteger = Field(ge=0, le=2**53 - 1)
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="gallery-relative path",
        json_schema_extra={"pattern": PLAN_PATH_PATTERN},
    )
    content_hash: str = Field(pattern="^[0-9a-f]{64}$", description="the file's SHA-256 when planned")
    action: ActionName

    @field_validator("path")
    @classmethod
    def _inside_the_gallery(cls, path: str) -> str:
        if not re.match(PLAN_PATH_PATTERN, path):
            raise ValueError("must be a path inside the gallery, outside its trash folder")
        return path


class PlanGroupIn(BaseModel):
    # No item count: the request body's byte limit bounds a plan (a schema limit of thousands of items
    # had the contract test build arrays that long for every boundary case).
    members: list[PlanMemberIn] = Field(
        min_length=1,
        description="at least one member is kept",
        json_schema_extra={"contains": {"type": "object", "properties": {"action": {"const": "keep"}}}},
    )

    @field_validator("members")
    @classmethod
    def _one_kept(cls, members: list[PlanMemberIn]) -> list[PlanMemberIn]:
        if not any(member.action == "keep" for member in members):
            raise ValueError("the group keeps no image: mark one member 'keep'")
        return members


class PlanIn(BaseModel):
    """A duplicates plan, as ``dmlsearch duplicates --plan`` writes it (other fields are ignored)."""

    version: PlanInteger = Field(ge=1, le=1, description="the plan format's version: 1")
    plan_id: str = Field(pattern=PLAN_ID_PATTERN, description="names its trash folder inside the gallery")
    groups: list[PlanGroupIn]


class LeftOut(BaseModel):
    path: ShownPath
    reason: str


class AppliedPlanOut(BaseModel):
    moved: list[ShownPath] = Field(description="files moved into the trash folder by this request")
    already: list[ShownPath] = Field(description="files already in the trash folder (an apply run again)")
    left: list[LeftOut] = Field(description="files not moved, and why")
    removed: int = Field(description="items removed from the index")
    handed: int = Field(
        description="items whose file was set aside while a byte copy of it was kept: the item now names the "
        "copy (same id and vector)"
    )
    trash: str = Field(description="the trash folder, relative to the gallery (it holds the plan)")
    plan_id: str = Field(description="undoes this apply: POST /v1/duplicates/undo")
    count: int = Field(description="items in the index now")


class UndoIn(BaseModel):
    plan_id: str = Field(pattern=PLAN_ID_PATTERN, description="the plan whose apply is undone")


class UndoneOut(BaseModel):
    moved: list[str] = Field(description="files put back from the trash folder by this request")
    already: list[str] = Field(description="files already back in place (an undo run again)")
    left: list[LeftOut] = Field(description="files left in the trash folder, and why")
    restored: int = Field(description="items put back under the ids they had")
    reindexed: int = Field(description="files indexed again under new ids (changed in the trash)")
    count: int = Field(description="items in the index now")


class ItemPageOut(BaseModel):
    items: list[ItemOut]
    total: int
    offset: int


class LabelCountOut(BaseModel):
    label: str
    count: int = Field(description="items with this label")


class LabelsOut(BaseModel):
    labels: list[LabelCountOut] = Field(description="every label in the index, in label order")


class AddedItemsOut(BaseModel):
    items: list[ItemOut]
    count: int = Field(description="items in the index after the addition")


class DeletedItemOut(BaseModel):
    deleted: ItemOut
    set_aside: list[ShownPath] = Field(
        description="its gallery file and the byte copies of it, moved into the trash folder (relative to "
        "the gallery)"
    )
    trash: str | None = Field(
        description="the trash folder, relative to the gallery (null: the index records no gallery folder)"
    )
    plan_id: str | None = Field(description="undoes the delete: POST /v1/duplicates/undo")
    count: int = Field(description="items in the index after the removal")


class ModelOut(BaseModel):
    fingerprint: str
    backbone: str
    head: str
    loss: str | None
    embedding_dim: int


class StatsOut(BaseModel):
    count: int
    dim: int
    backend: str
    index_type: str
    metric: str
    model_fingerprint: str
    achieved_recall: float | None
    model: ModelOut
    rerankers: list[str] = Field(
        description="rerank= values this server answers (pddm: the model carries its PDDM unit and the "
        "index gives back stored vectors)"
    )
    writes_enabled: bool


class ReadyOut(BaseModel):
    status: str
    model_fingerprint: str
    count: int


class ImageJsonIn(BaseModel):
    """A query image as base64 (a ``data:image/...;base64,`` prefix is accepted)."""

    model_config = ConfigDict(extra="forbid")
    image: Base64Image


class SearchJsonIn(ImageJsonIn):
    """A query image as base64, and the uploaded examples that refine its search (as base64 too)."""

    positive_images: list[Base64Image] = Field(
        default_factory=list,
        max_length=defaults.MAX_EXAMPLES,
        description="more like these: positive examples, beside the item ids of `positive`",
    )
    negative_images: list[Base64Image] = Field(
        default_factory=list,
        max_length=defaults.MAX_EXAMPLES,
        description="less like these: negative examples, beside the item ids of `negative`",
    )


class ImagesJsonIn(BaseModel):
    """Several images as base64."""

    model_config = ConfigDict(extra="forbid")
    images: list[Base64Image] = Field(min_length=1)


class NewItemsJsonIn(BaseModel):
    """Images to add as base64, with no label, one label for all, or one label per image."""

    model_config = ConfigDict(extra="forbid")
    images: list[Base64Image] = Field(min_length=1)
    labels: list[
        Annotated[str, Field(min_length=1, max_length=MAX_LABEL_CHARS, pattern=LABEL_PATTERN)] | None
    ] = Field(
        default_factory=list,
        description="none, one for every image, or one per image (in order; another count is 422 "
        "invalid_request)",
    )


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorOut(BaseModel):
    error: ErrorBody


# A route's documented responses by status, as FastAPI types its ``responses`` argument.
Responses = dict[int | str, dict[str, Any]]


class ReloadIn(BaseModel):
    index_path: str | None = Field(
        None,
        min_length=1,
        description="index directory on the server to serve from now on; default: the configured path again",
    )
    model_path: str | None = Field(
        None,
        min_length=1,
        description="model.onnx for an index that carries none (built before indexes stored their model); "
        "default: the model the index carries",
    )


class ReloadOut(BaseModel):
    status: str
    index_path: str
    model_fingerprint: str
    previous_model_fingerprint: str | None
    count: int
    took_ms: float


class PlotOut(BaseModel):
    name: str
    caption: str
    url: str = Field(description="GET it for the PNG.")


class ModelCardOut(BaseModel):
    """The served model's card; with its training run's proof when that run's files are on this server."""

    fingerprint: str
    backbone: str
    head: str
    loss: str | None
    recipe: str | None = Field(description="The training recipe (training/recipes.py), when recorded.")
    mode: str | None = Field(description="frozen, partial or finetune; none for the pretrained backbone.")
    embedding_dim: int
    exported: str = Field(description="When model.onnx was written (ISO 8601).")
    trained: str | None = Field(description="When the selected checkpoint was saved (ISO 8601).")
    run: str | None = Field(description="The training run's directory name.")
    best_step: int | None
    validation: dict[str, float] = Field(description="The selected checkpoint's validation metrics.")
    validation_check: ValidationCheck | None = Field(
        description="The export's check against the untrained model on the validation classes; passed "
        "false: exported with --force although not shown better. Null for the pretrained model."
    )
    evaluation: dict[str, Any] | None = Field(
        description="The run's `dmlsearch eval` result (eval.json): trained vs untrained, CI, verdict."
    )
    report_available: bool
    plots: list[PlotOut] = Field(description="The plots of the run's `dmlsearch report`.")


class PeakOut(BaseModel):
    """This image's region of the two that matched: square windows of grid positions (3 x 3 on the 7 x 7
    grid), one in each image, whose positions' contributions point most alike, beyond how alike each is to
    the other image's positions on average (docs/architecture.md, "Why a result matched")."""

    box: tuple[int, int, int, int] = Field(description="x0, y0, x1, y1 in pixels of the model's view.")
    share: float = Field(
        description="The part of the cosine carried between this region and the other image's outlined "
        "region, in the cosine's units: share / cosine is the part of the match the two outlined regions "
        "carry (0.022 of a cosine of 0.839: 2.6% of the match; summary says it in words)."
    )


class HeatmapOut(BaseModel):
    """One image's share of the cosine, over the model's view of it: the centre square of the upright image
    (shorter side), as the model saw it. ``grid`` has ``h`` rows of ``w`` positions (7 x 7 for a 224-pixel
    input), row 0 at the top; ``sum(grid) + rest == total``, which is the cosine within float rounding."""

    grid: list[list[float]] = Field(
        description="Each area's part of the cosine, row by row: above 0 it made the two images alike (the "
        "overlay colours it), below 0 less alike."
    )
    rest: float = Field(
        description="The part of the cosine that no area carries: the model's fixed offset (its embedding "
        "head's biases); 0 for a model without a head."
    )
    total: float = Field(description="sum(grid) + rest: the cosine, within float rounding.")
    peak: PeakOut
    overlay_jpeg: str = Field(
        description="The model's view with the positions that raised the similarity coloured and the peak "
        "outlined (JPEG, base64).",
        json_schema_extra={"contentEncoding": "base64", "contentMediaType": "image/jpeg"},
    )

    @classmethod
    def of(cls, heatmap: Heatmap, overlay_jpeg: bytes) -> HeatmapOut:
        return cls(
            grid=heatmap.grid.astype(float).tolist(),
            rest=heatmap.rest,
            total=heatmap.total,
            peak=PeakOut(box=heatmap.peak_box, share=heatmap.peak.share),
            overlay_jpeg=base64.b64encode(overlay_jpeg).decode("ascii"),
        )


class ExplainOut(BaseModel):
    """Why an item matched a query: the cosine of their embeddings, split over the positions of each."""

    item_id: int
    query_item_id: int | None = Field(description="The query's item id; null for an uploaded query.")
    cosine: float = Field(
        description="The similarity: the cosine of the two embeddings (1: the same picture)."
    )
    query: HeatmapOut
    item: HeatmapOut
    model_fingerprint: str
    summary: str = Field(
        description="The explanation in words, as `dmlsearch explain` prints it: the similarity, what the "
        "colours show and the part of the match the outlined regions carry."
    )


def _base64_data(value: object) -> object:
    """Base64 text to its bytes, refusing what is not strictly base64 (a 422 naming the field)."""
    if not isinstance(value, str):
        return value
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as err:
        raise ValueError(f"not valid base64: {err}") from None


Base64Data = Annotated[
    bytes, BeforeValidator(_base64_data), WithJsonSchema({"type": "string", "contentEncoding": "base64"})
]
# No maximum: FastAPI writes a body's bounds as floats, and 2**63 - 1 as a double is 2**63, which would let
# schema-valid ids through to a 422; an id past int64 names no item (404, engine.serve.feedback).
ITEM_ID = Field(ge=0)


class FeedbackIn(BaseModel):
    """One judgment (👍 or 👎) on a result of a search: the query as an item id or as the uploaded image
    (base64), the result's item id, and the sign."""

    model_config = ConfigDict(extra="forbid")

    query_item: Annotated[int, ITEM_ID] | None = Field(None, description="the query's item id")
    query_image: Base64Data | None = Field(
        None, description="the uploaded query image (base64): kept as its sha256 and its embedding"
    )
    result: Annotated[int, ITEM_ID] = Field(description="the judged result's item id")
    sign: Literal[1, -1] = Field(description="1: this result is right for the query (👍); -1: it is not (👎)")

    @model_validator(mode="after")
    def _one_query(self) -> FeedbackIn:
        if (self.query_item is None) == (self.query_image is None):
            raise ValueError("give the query as query_item or as query_image, one of them")
        return self


class JudgmentOut(BaseModel):
    id: int
    query_item: int | None = Field(description="the query's item id; null for an uploaded query")
    query_hash: str | None = Field(description="an uploaded query image's sha256; null for an item query")
    query_embedded: bool = Field(
        description="whether an uploaded query's embedding is kept (dropped when the index was rebuilt with "
        "another model than model_fingerprint)"
    )
    result: int = Field(description="the judged result's item id")
    sign: int = Field(description="1 (👍) or -1 (👎)")
    time: str = Field(description="when it was made (ISO 8601, UTC)")
    model_fingerprint: str = Field(description="the model that served the judged result")

    @classmethod
    def of(cls, judgment: Judgment) -> JudgmentOut:
        query = judgment.query
        return cls(
            id=judgment.id,
            query_item=query.item,
            query_hash=query.content_hash,
            query_embedded=query.embedding is not None,
            result=judgment.result,
            sign=judgment.sign,
            time=judgment.time,
            model_fingerprint=judgment.model_fingerprint,
        )


class JudgmentPageOut(BaseModel):
    judgments: list[JudgmentOut]
    total: int
    offset: int


class DeletedJudgmentOut(BaseModel):
    deleted: JudgmentOut
