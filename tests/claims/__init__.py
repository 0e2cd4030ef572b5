"""The claims ledger: every "within", "bit-identical", "equal" and percentage claim of README.md and docs/, with
the test that holds it and that test's bound. One module per page; `python -m tests.claims` checks the ledger
against the pages and the tests and writes docs/claims.md; tests/test_claims.py fails when either drifts."""
