"""OLMo 3 (`olmo3`, Ai2): OLMo 2's layer (norms after each sublayer, q/k norms over the whole projection) with
local layers (`layer_types` "sliding_attention") attending within `sliding_window` and global layers; split over
tensor-parallel ranks as OLMo 2 is."""

import dataclasses

from models.families import register
from models.families.olmo2 import OLMO2

# The local layers' window shorter than the test rows.
register(dataclasses.replace(OLMO2, model_type="olmo3", prefix="Olmo3", tiny=dict(sliding_window=4)))
