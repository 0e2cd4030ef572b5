"""docs/measured.md: its table rows in two modules (the first and second half of the page), each under the line budget."""

from tests.claims import measured_1, measured_2

CLAIMS = measured_1.CLAIMS + measured_2.CLAIMS
