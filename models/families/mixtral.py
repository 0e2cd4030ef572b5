"""Mixtral (`mixtral`): Mistral's attention (window on every layer) and a sparse block in every layer, its experts
one key each on the hub (`block_sparse_moe.experts.N.w1/w3/w2`), top-k weights always renormalised."""

from models.families import Family, MoeSpec, register

# Experts one key each on the hub under `block_sparse_moe`, top-k always renormalised (MiniMax-M2's too).
MIXTRAL_MOE = MoeSpec(
    "block_sparse_moe",
    ("w1", "w3", "w2"),
    "num_local_experts",
    "intermediate_size",
    every_layer=True,
    always_renormalise=True,
)

register(
    Family(
        "mixtral",
        "Mixtral",
        window_everywhere=True,
        moe=MIXTRAL_MOE,
        tiny=dict(num_local_experts=4, num_experts_per_tok=2),
    )
)
