"""Every claim of README.md and docs/ names the test that holds it (tests/claims/, one module per page): one entry per
claim (each figure of a claim sentence, shares "of a step" and "2.8x" ratios included, is in the words of an entry),
its words are on the page, its assertion is in the test (never a benchmark), its bound a number of that test's source
(read from it, not typed beside it) at most ~10x the figure quoted
(or the page says what the test holds), and docs/claims.md, the generated list, is current."""

from __future__ import annotations

from tests.claims.ledger import PAGE, problems, render


def test_every_claim_is_held_by_a_test_at_its_figure():
    found = problems()
    assert not found, "\n".join(found)


def test_the_claims_page_is_generated_from_the_ledger():
    assert PAGE.read_text() == render(), "docs/claims.md is stale: run python -m tests.claims"


def test_the_ledger_refuses_a_sentence_held_by_fewer_entries_than_it_has_claims():
    """Planted pages: a sentence with two figures and one entry; a "0.5 of a step" with none; a bound 10x looser than
    the figure quoted; one typed beside its assertion, not read from it; a benchmark named as a test. Each is a
    problem; with an entry per claim the page is clean."""
    from tests.claims.held import PARITY, PARITY_2E6
    from tests.claims.kinds import Benchmark, Claim
    from tests.claims.ledger import page_problems

    two = "The logits are within 2e-7 of transformers', and the loss within 1e-6."
    one_entry = (Claim(says="within 2e-7 of transformers'", test=PARITY, holds=PARITY_2E6, bound=2e-6, figure=2e-7),)
    (problem,) = page_problems("planted.md", two, one_entry)
    assert problem.startswith('planted.md: 1e-6 of "The logits are within 2e-7') and "one entry per claim" in problem
    both = (*one_entry, Claim(says="the loss within 1e-6", test=PARITY, holds=PARITY_2E6, bound=2e-6, figure=1e-6))
    assert page_problems("planted.md", two, both) == []

    step = "Each save blocked the loop for 0.5 of a step."
    assert page_problems("planted.md", step, ()) == [f"planted.md: no entry for {step!r}"]
    measured = (Benchmark(says="0.5 of a step", by="benchmarks/save_stall.py"),)
    assert page_problems("planted.md", step, measured) == []

    loose = "The logits are within 1e-8 of transformers'."
    entry = Claim(says="within 1e-8 of transformers'", test=PARITY, holds=PARITY_2E6, bound=2e-6, figure=1e-8)
    (problem,) = page_problems("planted.md", loose, (entry,))
    assert "bound 2e-06 is 200x the figure 1e-08" in problem
    typed = Claim(says="within 1e-8 of transformers'", test=PARITY, holds=PARITY_2E6, bound=3e-8, figure=1e-8)
    (problem,) = page_problems("planted.md", loose, (typed,))
    assert "bound 3e-08 is no number of tests/workers/forward_parity.py::main" in problem
    ratio = "Saves took 0.97x the time of `cp`."
    as_test = Claim(says="0.97x the time of `cp`", test="benchmarks/convert_memory.py::main", holds="x", bound=None)
    (problem,) = page_problems("planted.md", ratio, (as_test,))
    assert "benchmarks/convert_memory.py::main is a benchmark, not a test" in problem
