from tests.claims.kinds import Claim

CLAIMS = (
    Claim(
        says="each case hashes the inputs and earlier outputs before and after the refused command and finds them byte-identical",
        test="tests/catalogue.py::run_case",
        holds='assert digest(inputs) == before, "inputs changed"',
        bound=None,
    ),
    Claim(
        says="`tests/test_security.py` plants each kind (its size and hash right) with a FIFO behind it, which would "
        "block whoever opened it: each command ends within seconds with its line",
        test="tests/test_security.py::test_a_manifest_names_only_the_checkpoints_own_files",
        holds='assert len(lines) == 1 and lines[0].startswith("convert2ckpt:") and where in lines[0], proc.stderr',
        bound=None,
    ),
)
