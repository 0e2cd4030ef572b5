"""docs/measured.md: its table rows in five modules (in the page's order), each under the line budget."""

from tests.claims import families_3, measured_1, measured_2, measured_3, measured_4, measured_5

CLAIMS = (
    measured_1.CLAIMS
    + measured_2.CLAIMS
    + measured_3.CLAIMS
    + families_3.MEASURED
    + measured_4.CLAIMS
    + measured_5.CLAIMS
)
