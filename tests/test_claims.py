"""Every claim of README.md and docs/ names the test that holds it (tests/claims/, one module per page): its words
are on the page, its assertion is in the test, its bound at most ~10x the figure quoted (or the page says what the
test holds), and docs/claims.md, the generated list, is current."""

from __future__ import annotations

from tests.claims.ledger import PAGE, problems, render


def test_every_claim_is_held_by_a_test_at_its_figure():
    found = problems()
    assert not found, "\n".join(found)


def test_the_claims_page_is_generated_from_the_ledger():
    assert PAGE.read_text() == render(), "docs/claims.md is stale: run python -m tests.claims"
