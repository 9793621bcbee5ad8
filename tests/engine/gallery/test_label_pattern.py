"""The label rule the API schema states (LABEL_PATTERN, judged by a JSON Schema validator) is the rule the
server applies (check_label), character by character: what the schema allows is stored, what it refuses is
refused."""

from __future__ import annotations

import pytest

from engine.gallery.labels import LABEL_PATTERN, MAX_LABEL_CHARS, InvalidLabelError, check_label

jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="comes with schemathesis (the dev extra)")
SCHEMA = jsonschema_rs.validator_for(
    {"type": "string", "pattern": LABEL_PATTERN, "maxLength": MAX_LABEL_CHARS}
)


def _server_takes(label: str) -> bool:
    try:
        check_label(label)
    except InvalidLabelError:
        return False
    return True


# Every code point of the BMP, and every 61st beyond it (letters of scripts newer than Python's Unicode
# tables among them), inside a label, at its start and at its end.
CODE_POINTS = [cp for cp in [*range(0x10000), *range(0x10000, 0x110000, 61)] if not 0xD800 <= cp < 0xE000]


@pytest.mark.parametrize("place", ["a{}a", "{}a", "a{}"])
def test_the_schema_pattern_and_the_server_agree_on_every_character(place: str) -> None:
    disagree = [
        f"U+{cp:04X}"
        for cp in CODE_POINTS
        if SCHEMA.is_valid(label := place.format(chr(cp))) != _server_takes(label)
    ]
    assert disagree == []


def test_the_pattern_keeps_the_shape_rules() -> None:
    for refused in [" a", "a ", ".a", "", "a/b", "a\u202eb", "%2F", "a\nb"]:
        assert not SCHEMA.is_valid(refused) and not _server_takes(refused), refused
    for taken in ["a", "a.", "Audi A4 (2012) - B8, coupé's", "猫", "\u0905\u093f"]:
        assert SCHEMA.is_valid(taken) and _server_takes(taken), taken
