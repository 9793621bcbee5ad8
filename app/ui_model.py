"""The Streamlit "Model" page: the served model's card and, when its training run's report is on the
server, the proof that training helped (eval verdict and the report's plots)."""

from __future__ import annotations

import streamlit as st

from app.client import ApiCallError, SearchClient
from app.ui_display import plain

VERDICT_BOX = {"better": st.success, "not distinguishable": st.info, "worse": st.error}
# A field the model has no value for (a pretrained backbone has no run). Not "-": st.table renders cells
# as markdown, where a lone "-" is an empty list item, drawn as a bullet.
NOT_APPLICABLE = "—"


def _card_rows(card: dict) -> dict[str, str]:
    dash = NOT_APPLICABLE
    return {
        "Backbone": card["backbone"],
        "Head": card["head"],
        "Loss": card["loss"] or "none (pretrained backbone)",
        "Recipe": card["recipe"] or dash,
        "Mode": card["mode"] or dash,
        "Embedding": f"{card['embedding_dim']}-d",
        "Fingerprint": card["fingerprint"][:16],
        "Trained": card["trained"] or dash,
        "Exported": card["exported"],
        "Run": card["run"] or dash,
        "Selected step": dash if card["best_step"] is None else str(card["best_step"]),
    }


def _show_evaluation(evaluation: dict) -> None:
    difference = evaluation["recall@1_difference"]
    trained, untrained = evaluation["trained"], evaluation["untrained"]
    text = (
        f"Trained vs the untrained backbone on {evaluation['images']} {evaluation['split']} images: "
        f"**{evaluation['verdict']}**. Recall@1 {100 * trained['recall@1']:.2f} vs "
        f"{100 * untrained['recall@1']:.2f} ({100 * difference['difference']:+.2f} points, "
        f"{100 * difference['level']:.0f}% CI "
        f"[{100 * difference['low']:+.2f}, {100 * difference['high']:+.2f}])"
    )
    VERDICT_BOX.get(evaluation["verdict"], st.info)(text)
    names = [name for name in trained if name in untrained]
    st.table(
        {
            "metric": names,
            "untrained": [f"{100 * untrained[name]:.2f}" for name in names],
            "trained": [f"{100 * trained[name]:.2f}" for name in names],
        }
    )


def render_model(client: SearchClient) -> None:
    st.subheader("Served model")
    try:
        card = client.model()
    except ApiCallError as err:
        st.error(f"The model card is unavailable: {plain(err)}")
        return
    check = card.get("validation_check")
    if check is not None and not check["passed"]:
        st.error(
            "This model failed the validation check and was exported with --force: it is not shown to "
            f"search better than the untrained model ({check['detail']})."
        )
    rows = _card_rows(card)
    st.table({"field": list(rows), "value": list(rows.values())})
    if card["validation"]:
        line = " · ".join(f"{name} {100 * value:.2f}" for name, value in card["validation"].items())
        st.caption(plain(f"validation: {line}"))
    evaluation = card["evaluation"]
    failure = (evaluation or {}).get("learned_nothing")
    if failure:  # its checkpoint is the head training started from: not a trained model's proof
        st.error(
            plain(
                f"This model learned nothing in training: {failure}. Its selected checkpoint is step 0, "
                "the head training started from, so it is not presented as a trained model."
            )
        )
    elif evaluation is not None:
        _show_evaluation(evaluation)
    if not card["plots"]:
        if card["loss"] is None:
            st.info(
                "This is the pretrained backbone, untrained, so there is no training report. Train on your "
                "labelled photos (`dmlsearch train`), then `dmlsearch report RUN` shows the proof here."
            )
        else:
            st.info(
                "No training report for this model on the server. Run `dmlsearch report RUN` on the run "
                "it was exported from to see its plots here."
            )
        return
    st.subheader("Training report")
    for plot in card["plots"]:
        try:
            st.image(client.plot(plot["url"]), caption=plot["caption"], width="content")  # natural size
        except ApiCallError as err:
            st.warning(plain(f"Plot {plot['name']} is unavailable: {err}"))
