"""FlexOlmo (`flex_olmo`, Ai2): OLMo 2's layer (each sublayer's output normalised before the residual add, q/k norms
over the whole projection: under tensor parallelism split with the heads, their statistics summed over the ranks)
with OLMoE's sparse block in every layer (a softmax router, top-k renormalised when `norm_topk_prob`, experts one key
each on the hub) and transformers' load-balancing loss."""

import dataclasses

from models.families import register
from models.families.olmo2 import OLMO2
from models.families.olmoe import OLMOE_MOE

register(
    dataclasses.replace(
        OLMO2,
        model_type="flex_olmo",
        prefix="FlexOlmo",
        moe=OLMOE_MOE,
        # (its config's pad token, 100277, is past a tiny vocabulary)
        tiny=dict(num_experts=4, num_experts_per_tok=2, head_dim=16, pad_token_id=None),
    )
)
