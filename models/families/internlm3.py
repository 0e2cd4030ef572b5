"""InternLM3 (`internlm3`): transformers maps its config (InternLM3Config) to LLaMA's model (LlamaForCausalLM), so
its layers are LLaMA's: q/k/v/o biases when `attention_bias`, MLP biases when `mlp_bias`, an explicit `head_dim`."""

from models.families import Family, register

register(
    Family(
        "internlm3",
        "Llama",
        package="llama",
        config_name="InternLM3Config",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        tiny=dict(head_dim=16),
    )
)
