"""The serving guide's table of request fields is the generated one, and it covers every field the parsers take."""

from pathlib import Path

from baige_ray.serving.openai_api import COMPLETION_FIELDS
from baige_ray.serving.openai_chat import CHAT_FIELDS
from baige_ray.serving.openai_fields import field_support_table

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "serving.md"


def test_the_guides_field_table_is_the_generated_one():
    assert field_support_table() in GUIDE.read_text(), (
        "regenerate with: python -c 'from baige_ray.serving.openai_fields import field_support_table; "
        "print(field_support_table())' and paste it into docs/guides/serving.md")


def test_every_field_a_parser_takes_has_a_row():
    table = field_support_table()
    assert all(f"| `{field}` |" in table for field in set(COMPLETION_FIELDS) | set(CHAT_FIELDS))
