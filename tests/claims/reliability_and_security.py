from tests.claims.kinds import Claim

CLAIMS = (
    Claim(
        says="each case hashes the inputs and earlier outputs before and after the refused command and finds them byte-identical",
        test="tests/catalogue.py::run_case",
        holds='assert digest(inputs) == before, "inputs changed"',
        bound=None,
    ),
)
