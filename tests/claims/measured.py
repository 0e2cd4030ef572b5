"""docs/measured.md: its table rows in three modules (in the page's order), each under the line budget."""

from tests.claims import families_3, measured_1, measured_2, measured_3

CLAIMS = measured_1.CLAIMS + measured_2.CLAIMS + measured_3.CLAIMS + families_3.MEASURED
