"""State that crosses layers (models/carry.py): what each stage boundary carries by name, and Gemma 4's per-layer
inputs and shared K/V through every placement of a cut, forward and backward, against transformers (single process;
the launches of tests/test_parity.py and tests/test_training.py run the same models on several ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from checkpoint.expert_layouts import fuse_per_expert
from models.carry import carried_bytes, carried_tensors, layout
from models.families import FAMILIES, resolve_attention
from models.head import split_stats, tied_lm_head_forward
from models.hub_names import memory_key
from models.key_table import all_layer_keys, is_carried
from models.layers import DecoderOptions, build_layer
from models.pipe_layout import pipe_layers
from tests.conftest import hf_state
from tests.hub_extras import perturb
from tools.tiny_models import tiny_config


def gemma4(**overrides):
    config = tiny_config("gemma4_text", tie_word_embeddings=True, **overrides)
    config._attn_implementation = "sdpa"
    return config


def test_the_carry_names_what_crosses_each_boundary():
    """Gemma 4's tiny model (6 layers, local and global alternating, the last two reusing K/V): the tokens reach block
    0 only, which makes every block's per-layer inputs; the local K/V travel from block 2 (the last local layer that
    computes its own) to block 4, the global K/V from block 3 to block 5, and neither after its last reader; the bytes
    the planner counts at each cut are those of the tensors there."""
    config = gemma4()
    lay = layout(config)
    kv = {kind: (f"kv.{kind}.k", f"kv.{kind}.v") for kind in ("sliding_attention", "full_attention")}
    assert [lay.carried(i) for i in range(7)] == [
        ("input_ids",),
        ("per_layer_inputs",),
        ("per_layer_inputs",),
        ("per_layer_inputs", *kv["sliding_attention"]),
        ("per_layer_inputs", *kv["full_attention"], *kv["sliding_attention"]),
        ("per_layer_inputs", *kv["full_attention"]),
        (),
    ]
    assert lay.reads(4) == ("per_layer_inputs", *kv["sliding_attention"]) and lay.makes(3) == kv["full_attention"]
    for after in range(7):
        for tp in (1, 2):
            tensors = carried_tensors(config, after, 2, 24, 24, torch.float32, tp)
            floating = sum(t.numel() * 4 for t in tensors.values() if t.is_floating_point())
            assert carried_bytes(config, after, 2, 24, 4, tp) == floating, (after, tp)
    assert not layout(tiny_config("llama")).slots  # other families carry only the hidden states (and positions)


def cut_run(config, state: dict, ids: torch.Tensor, labels: torch.Tensor, cuts: tuple[int, ...], options=None):
    """The pipeline's layers on `ids` in stages cut after the pipeline layers `cuts`, each stage's output handed to
    the next as DeepSpeed's pipeline does (a detached copy; floating tensors take a gradient) and the gradient of
    each handed tensor sent back; returns (logits, the loss, {HF key: gradient})."""
    keys = all_layer_keys(config)
    layers = [x for x in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings) if x.has_file]
    modules = []
    for layer in layers:
        module = build_layer(layer, config, options or DecoderOptions())
        module.load_state_dict({ours: state[hf].clone() for ours, hf in keys[layer.index].items()})
        modules.append(module)
    x = (ids, torch.arange(ids.shape[1]).expand_as(ids))
    stages, received, outputs = [[]], [None], []
    for layer, module in zip(layers, modules):
        stages[-1].append(module)
        if layer.index in cuts:
            stages.append([])
    for i, stage in enumerate(stages):
        for module in stage:
            x = module(x)
        if i == len(stages) - 1:
            break
        outputs.append(x)
        x = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in x)  # the next stage's receive
        received.append(x)
    logits, stats = split_stats(tied_lm_head_forward(modules[0], x) if config.tie_word_embeddings else x)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    if stats is not None:  # the router statistics get their (zero: no load-balancing loss) gradient back
        loss = loss + 0.0 * stats.sum()
    loss.backward()
    for out, inp in zip(reversed(outputs), reversed(received[1:])):  # each stage's backward from its outputs
        pairs = [(o, i.grad) for o, i in zip(out, inp) if o.is_floating_point()]
        assert all(g is not None for _, g in pairs), "a carried floating tensor got no gradient back"
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads = {}  # by transformers' in-memory names (our layers are its layers: the same names below each)
    for layer, module in zip(layers, modules):
        for name, param in module.named_parameters():
            if not param.requires_grad:  # frozen as transformers computes it without gradients (GLM-5's indexer)
                continue
            if layer.kind == "decoder":
                hf = f"model.{name[4:]}" if name.startswith("ple.") else f"model.layers.{layer.block}.{name}"
            else:  # (DeepSeek-V4's hub names its head `head.weight`)
                hf = memory_key(config, keys[layer.index][name])
            grads[hf] = param.grad
    return logits, loss, grads


CUT_MODELS = {
    "gemma4-ple-shared-kv": gemma4,
    "gemma4-ple": lambda: gemma4(num_kv_shared_layers=0),
    "gemma4-31b-like": lambda: gemma4(num_kv_shared_layers=0, hidden_size_per_layer_input=0),
    # GLM-5: blocks 0 and 1 run the indexer, 2 and 3 share block 1's top-k keys (rows of 16, 4 keys kept)
    "glm_moe_dsa": lambda: tiny_config("glm_moe_dsa", num_key_value_heads=4),
    # Gemma 4 26B-A4B's MoE block (experts beside the dense MLP in every layer) on the tiny model above
    "gemma4-moe": lambda: gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    # DeepSeek-V4: 3 residual streams through every cut, hash layers 0, 1 and 3 reading the carried tokens
    "deepseek_v4": lambda: tiny_config("deepseek_v4"),
}  # (transformers' Gemma 4 fails on shared K/V without PLE: no such model exists)


@pytest.mark.parametrize("name", list(CUT_MODELS))
def test_every_cut_gives_transformers_logits_and_gradients(name, tmp_path):
    """Gemma 4 cut into two stages after each of its 6 blocks in turn (cuts between each K/V's maker and its reader,
    cuts that keep them on one stage), and into a stage per block; GLM-5 likewise (its shared index made by block 1,
    read by blocks 2 and 3): logits bit-identical to transformers', and the gradient of every weight (the K/V
    makers' projections and norms, block 0's per-layer embeddings, every layer's per-layer gate; GLM-5's latent
    attention, routers and experts) bit-identical to transformers' own backward: the carried tensors' gradients come
    back through the cut and add up in transformers' order; the same with every block recomputed in backward."""
    from transformers import AutoModelForCausalLM

    config = CUT_MODELS[name]()
    config._attn_implementation = resolve_attention(config, None)  # (DeepSeek-V4's: eager)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    hf.save_pretrained(tmp_path)
    state = fuse_per_expert(hf_state(str(tmp_path)), config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.roll(ids, -1, dims=1)
    logits = hf(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    reference = {key: p.grad for key, p in hf.named_parameters()}
    if config.tie_word_embeddings:
        reference["lm_head.weight"] = None  # tied: the embedding's gradient holds the head's
    n = config.num_hidden_layers
    every = [((), DecoderOptions(checkpoint_every=1))]  # every block recomputed in backward: what it made, remade
    for cuts, options in [*((c, None) for c in [(), *[(c,) for c in range(1, n + 1)], tuple(range(1, n + 1))]), *every]:
        ours, _, grads = cut_run(config, state, ids, labels, cuts, options)
        assert torch.equal(ours, logits), cuts
        assert set(grads) == {k for k, v in reference.items() if v is not None}, cuts
        for key, grad in grads.items():
            assert torch.equal(grad, reference[key]), (key, cuts, float((grad - reference[key]).abs().max()))


def test_dropping_a_carried_tensor_changes_the_logits(tmp_path):
    """Negative controls, each against transformers' logits on the same weights: the reusing layers computing their
    own K/V from their own input (what a converter that ignores sharing would build: the hub's unread k/v tensors of
    those layers loaded into a model without sharing), and the per-layer inputs dropped (zeros), change them."""
    from transformers import AutoModelForCausalLM

    from tests.hub_extras import add_unread_kv

    config = gemma4(
        use_double_wide_mlp=False
    )  # (reusing layers' MLPs as wide as the rest: one set of weights fits both)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    hf.save_pretrained(tmp_path)
    unread = add_unread_kv(str(tmp_path))
    state = hf_state(str(tmp_path))
    assert unread and all(is_carried(k, config) for k in unread)  # kept aside at conversion, not loaded
    ids = torch.randint(0, config.vocab_size, (2, 12))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert torch.equal(cut_run(config, state, ids, labels, (3,))[0], reference)
    own_kv = gemma4(
        use_double_wide_mlp=False, num_kv_shared_layers=0
    )  # every layer its own K/V: the reusing layers' from the hub's tensors
    wanted = {hf for keys in all_layer_keys(own_kv).values() for hf in keys.values()}
    assert wanted == set(state)  # the hub's unread tensors are exactly what the reusing layers would need
    recomputed = (cut_run(own_kv, state, ids, labels, (3,))[0] - reference).abs().max()
    ple = ("per_layer_model_projection", "embed_tokens_per_layer")
    zero_ple = {k: torch.zeros_like(v) if k.split(".")[1] in ple else v for k, v in state.items()}
    dropped = (cut_run(config, zero_ple, ids, labels, (3,))[0] - reference).abs().max()
    print(f"max |logit difference|: K/V recomputed in the reusing layers {recomputed:.3g}, no PLE {dropped:.3g}")
    assert recomputed > 1e-2 and dropped > 1e-2  # logits of at most 2 (soft-capped); equal ones differ by 0


def test_dropping_the_shared_index_changes_the_logits(tmp_path, monkeypatch):
    """GLM-5's negative control: its shared layers attending every key (the shared index dropped: an index holding
    every position, which leaves only the causal mask) change the logits, where the carried index gives
    transformers' own; the index crosses the cut between blocks 1 and 2 as int32, with no gradient."""
    from transformers import AutoModelForCausalLM

    from models.carry import LayerCarry

    config = CUT_MODELS["glm_moe_dsa"]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    hf.save_pretrained(tmp_path)
    state = fuse_per_expert(hf_state(str(tmp_path)), config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert layout(config).carried(2) == ("index.1",)
    assert carried_tensors(config, 2, 2, 16, 16, torch.float32)["index.1"].dtype == torch.int32
    assert torch.equal(cut_run(config, state, ids, labels, (2,))[0], reference)
    kwargs = LayerCarry.kwargs

    def every_key(self, layer, hidden, carried):
        out, context = kwargs(self, layer, hidden, carried)
        if out.get("prev_topk_indices") is not None:
            b, s, _ = out["prev_topk_indices"].shape
            out["prev_topk_indices"] = torch.arange(s, dtype=torch.int32).expand(b, s, s)
        return out, context

    monkeypatch.setattr(LayerCarry, "kwargs", every_key)
    dense = (cut_run(config, state, ids, labels, (2,))[0] - reference).abs().max()
    print(f"GLM-5's shared layers attending every key: max |logit difference| {dense:.3g}")
    assert dense > 1e-3


def test_dropping_a_stream_or_the_routing_tokens_changes_the_logits(tmp_path, monkeypatch):
    """DeepSeek-V4's negative controls: one of its 3 residual streams zeroed from the embedding on (the streams
    are [B, S, N, H] through every layer and cut), and its hash layers routed by other tokens than the row's (the
    carried tokens dropped: the next position's), each change the logits, where the carried streams and tokens give
    transformers' own; the tokens cross the cut after block 2 as integers, to hash layer 3 only."""
    from transformers import AutoModelForCausalLM

    from models.carry import LayerCarry
    from models.layers import embedded

    config = CUT_MODELS["deepseek_v4"]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    hf.save_pretrained(tmp_path)
    state = hf_state(str(tmp_path))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert layout(config).carried(3) == ("input_ids",) and layout(config).carried(4) == ()
    assert torch.equal(cut_run(config, state, ids, labels, (3,))[0], reference)

    def one_stream_dropped(*args):
        out = embedded(*args)
        hidden = out[0].clone()
        hidden[:, :, 1] = 0.0  # [B, S, N, H]: stream 1 of 3
        return (hidden, *out[1:])

    with monkeypatch.context() as patch:
        patch.setattr("models.layers.embedded", one_stream_dropped)
        streams = (cut_run(config, state, ids, labels, (3,))[0] - reference).abs().max()
    kwargs = LayerCarry.kwargs

    def other_tokens(self, layer, hidden, carried):
        out, context = kwargs(self, layer, hidden, carried)
        if "input_ids" in out:
            out["input_ids"] = torch.roll(out["input_ids"], -1, dims=1)
        return out, context

    monkeypatch.setattr(LayerCarry, "kwargs", other_tokens)
    tokens = (cut_run(config, state, ids, labels, (3,))[0] - reference).abs().max()
    print(f"DeepSeek-V4 max |logit difference|: one stream dropped {streams:.3g}, other tokens routed {tokens:.3g}")
    assert streams > 1e-3 and tokens > 1e-3


def _tp_model_worker(rank: int, store: str, out: str) -> None:
    """Rank `rank` of 2: Gemma 4 with its MoE block (perturbed), every layer this rank's TP shard of it, one forward
    and backward of the vocab-parallel loss without and with sequence parallelism; saves each parameter's gradient."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from models.sharding import shard
    from models.tensor_parallel import TensorParallel, tp_layer_class_and_args, tp_tied_head_forward
    from models.tp_rules import tp_split
    from models.vocab_parallel_loss import vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        config = CUT_MODELS["gemma4-moe"]()
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(config)
        perturb(hf)
        state, keys = hf.state_dict(), all_layer_keys(config)
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        labels, group, results = torch.roll(ids, -1, dims=1), dist.new_group([0, 1]), {}
        for sp in (False, True):
            tp = TensorParallel(2, rank, group=group, sequence_parallel=sp)
            layers = [x for x in pipe_layers(config.num_hidden_layers, True) if x.has_file]
            modules = []
            for layer in layers:
                cls, args = tp_layer_class_and_args(layer, config, tp, DecoderOptions())
                modules.append(module := cls(*args))
                split = {o: tp_split(layer.kind, o, config) for o in keys[layer.index]}
                mine = {o: shard(state[h], split[o], rank, 2, config.vocab_size) for o, h in keys[layer.index].items()}
                module.load_state_dict(mine)
            x = (ids, torch.arange(16).expand_as(ids))
            for module in modules:
                x = module(x)
            logits, stats = split_stats(tp_tied_head_forward(config, tp)(modules[0], x))
            loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), tp, config.vocab_size) / 32
            (loss + 0.0 * stats.sum()).backward()
            results[sp] = {(i, n): p.grad for i, m in zip(layers, modules) for n, p in m.named_parameters()}
            results[sp] = {(layer.index, name): grad for (layer, name), grad in results[sp].items()}
        torch.save(results, out)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # (gloo's threads can abort the interpreter's teardown after the work is saved)


@pytest.mark.slow
def test_tp2_gives_the_whole_models_gradients_through_the_moe_block(tmp_path):
    """Gemma 4 with its MoE block (experts beside the dense MLP, the router's input outside any split region) split
    over TP=2, without and with sequence parallelism, every layer of it: one step's gradient of every parameter
    merged over the ranks equals the whole model's within 1e-5 of its scale (router, experts, per-layer inputs, the
    shared K/V's makers), and replicated parameters' gradients are identical on both ranks."""
    from transformers import AutoModelForCausalLM

    from models.sharding import REPLICA, merge
    from models.tp_rules import tp_split
    from tests.conftest import spawn_ranks

    ranks = [torch.load(o, weights_only=True) for o in spawn_ranks(_tp_model_worker, tmp_path)]
    config = CUT_MODELS["gemma4-moe"]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    perturb(hf)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(hf(input_ids=ids).logits.flatten(0, 1), torch.roll(ids, -1, dims=1).flatten()).backward()
    reference = dict(hf.named_parameters())
    layers = {x.index: x for x in pipe_layers(config.num_hidden_layers, True)}
    worst = 0.0
    for sp in (False, True):
        assert set(ranks[0][sp]) == set(ranks[1][sp])
        for index, name in ranks[0][sp]:
            layer = layers[index]
            hf_name = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}.get(layer.kind)
            if hf_name is None:
                hf_name = f"model.{name[4:]}" if name.startswith("ple.") else f"model.layers.{layer.block}.{name}"
            rule = tp_split(layer.kind, name, config)
            got = merge([r[sp][index, name] for r in ranks], rule, config.vocab_size)
            want = reference[hf_name].grad
            worst = max(worst, float((got - want).abs().max()) / max(1.0, float(want.abs().max())))
            if rule == REPLICA:
                assert torch.equal(ranks[0][sp][index, name], ranks[1][sp][index, name]), (sp, name)
    print(f"TP=2 Gemma 4 MoE: parameter gradients within {worst:.3g} of the whole model's (relative)")
    assert worst < 1e-5


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_norm_a_family_names_is_a_norm_of_its_layers(model_type):
    """`Family.norms` (summed over TP under sequence parallelism, entering TP regions) names modules its layers have:
    TP skips a norm a layer lacks (Gemma 4's PLE and MoE norms where those are off), so a misspelled one would
    silently lose its gradient sum. Each name is a norm of some layer of the tiny model (with its experts on too)."""
    from models.layers import decoder_layer_class

    family = FAMILIES[model_type]
    configs = [tiny_config(model_type)]
    if family.moe_when and not getattr(configs[0], family.moe_when):  # the tiny model's experts off: on too
        configs.append(tiny_config(model_type, **{family.moe_when: True}))
    names = set()
    with torch.device("meta"):
        for config in configs:
            for block in range(config.num_hidden_layers):
                names |= {n for n, _ in decoder_layer_class(model_type)(config, block).named_children()}
    assert set(family.norms) <= names and set(family.tp_entry_norms) <= set(family.norms), set(family.norms) - names


def test_lora_and_fresh_weights_on_layers_of_their_own_shape():
    """Gemma 4's layers differ: its K/V-reusing layers have no k/v projections, its global layers (values = keys) no
    v_proj, and some norms no weight (`v_norm`, the MoE router's). LoRA on k_proj and v_proj adapts exactly the layers
    that have them (PEFT refuses a layer with none of its targets: such a layer is left as it is), and a run from
    scratch initialises every layer (`init_weights`); DeepSeek-V4's hyper-connections, sinks and position biases too,
    as transformers initialises them."""
    from transformers import AutoModelForCausalLM

    from models.initialization import init_weights
    from models.lora import add_lora

    config = gemma4(enable_moe_block=True)
    layers = [build_layer(x, config) for x in pipe_layers(config.num_hidden_layers, True) if x.kind == "decoder"]
    add_lora(torch.nn.ModuleList(layers), 4, 8.0, 0.0, ["k_proj", "v_proj"], seed=0)
    adapted = [sorted({n.split(".lora_")[0] for n, _ in m.named_parameters() if ".lora_" in n}) for m in layers]
    assert adapted == [["self_attn.k_proj", "self_attn.v_proj"], ["self_attn.k_proj"]] * 2 + [[], []]
    for layer in layers:
        init_weights(layer, 0.02)
    assert all(torch.equal(m.layer_scalar, torch.ones(1)) for m in layers)
    # DeepSeek-V4 from scratch: every tensor set as transformers' own initialisation sets it (none left torch.empty)
    config = CUT_MODELS["deepseek_v4"]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    layers = [build_layer(x, config) for x in pipe_layers(config.num_hidden_layers, False) if x.has_file]
    for layer in layers:
        layer.apply(lambda m: [p.data.fill_(float("nan")) for p in m.parameters(recurse=False)])
        init_weights(layer, config.initializer_range)
    hub = {h: memory_key(config, h) for keys in all_layer_keys(config).values() for h in keys.values()}
    ours = {hub[h]: t for layer, keys in zip(layers, all_layer_keys(config).values()) for o, h in keys.items()
            for t in [layer.state_dict()[o]]}  # fmt: skip
    for name, tensor in hf.state_dict().items():
        theirs = ours.get(name)
        if theirs is None or not tensor.is_floating_point():  # fused experts (ours per expert), integer tables
            continue
        assert not theirs.isnan().any(), name
        if tensor.std() == 0 or name.endswith(("norm.weight", "_layernorm.weight")):  # constants: equal
            assert torch.equal(theirs, tensor), name
