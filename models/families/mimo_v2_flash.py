"""MiMo-V2-Flash (`mimo_v2_flash`, Xiaomi): sliding-window layers with twice the key/value heads of the full ones and
a learned sink per head (gpt-oss's: transformers computes it in its eager attention only), value heads narrower
than query heads (`v_head_dim`) scaled by `attention_value_scale`, and DeepSeek's sparse blocks (the sigmoid router
with its score bias, group-limited top-k, shared experts) in the layers `mlp_layer_types` lists as sparse. Under
tensor parallelism the sinks split with the heads, each layer's key/value heads with its own count; context
parallelism is refused in one line (Ulysses' all-to-all takes one shape of heads per model)."""

from dataclasses import replace

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "mimo_v2_flash",
        "MiMoV2Flash",
        qkv_bias="attention_bias",
        moe=replace(DEEPSEEK_MOE, first_dense="", layer_types="mlp_layer_types"),
        per_head=("self_attn.sinks",),
        cp_refused=(
            "sliding layers have twice the key/value heads of the full ones and values narrower than keys, which "
            "the Ulysses all-to-all's per-model head shapes do not take"
        ),
        hub_renames=True,  # the hub's `self_attn.attention_sink_bias` is transformers' `self_attn.sinks`
        flash_refused="its attention sinks need flash-attn kernels that take them (s_aux), not the flash-attn package",
        # DeepSeek's tiny router and experts; value heads of 12 under query heads of 16; its config's own layer
        # lists: layer 0 full attention and dense, the others sliding (window 4, twice the key/value heads) and sparse.
        tiny={k: v for k, v in DEEPSEEK_TINY.items() if k != "first_k_dense_replace"}
        | dict(head_dim=16, v_head_dim=12, sliding_window=4, attention_value_scale=0.7),
    )
)
