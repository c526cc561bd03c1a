import gc, math, os, shutil
from dataclasses import dataclass, field, asdict, replace
from .errors import KitError, bad_value
from .config import FSDPConfig
from .models import model_config, build_model

#| export
@dataclass
class PlanSpec:
    "One training setting to predict (and, on this machine, to measure)."
    model:str="small" # preset (tiny, small, llama-2-7b, ...) or config.json path
    world_size:int=2 # ranks sharing the parameters (GPUs)
    policy:str="TRANSFORMER_BASED_WRAP" # auto_wrap_policy: TRANSFORMER_BASED_WRAP or NO_WRAP
    reshard_after_forward:bool|int=True # True, False, or a group size
    mixed_precision:str="no" # "no" (fp32 compute) or "bf16" (param_dtype bf16, reduce_dtype fp32)
    activation_checkpointing:bool=False # recompute each decoder layer in backward
    method:str="full" # "full", "lora" (bf16 base) or "qlora" (4-bit NF4 base, bf16 storage)
    lora_r:int=8 # LoRA rank (all linear layers of the decoder)
    batch:int=2 # sequences per rank
    seq_len:int=64 # tokens per sequence
    cpu_offload:bool=False # sharded params, grads and optimizer state in host memory
    cp:int=1 # context-parallel ranks: each holds seq_len / cp tokens

    def fsdp_config(self) -> FSDPConfig:
        "The FSDPConfig of a full fine-tune in this setting."
        return FSDPConfig(auto_wrap_policy=self.policy, reshard_after_forward=self.reshard_after_forward,
                          mixed_precision=self.mixed_precision, activation_checkpointing=self.activation_checkpointing).check()

    def label(self) -> str:
        "A short name: model, ranks, method, policy, reshard, precision, checkpointing."
        policy = {"TRANSFORMER_BASED_WRAP": "layer", "NO_WRAP": "none", "PER_LINEAR": "linear"}.get(self.policy, self.policy)
        reshard = {True: "reshard", False: "keep"}.get(self.reshard_after_forward, f"to{self.reshard_after_forward}") if isinstance(self.reshard_after_forward, bool) else f"to{self.reshard_after_forward}"
        parts = [self.model, f"w{self.world_size}", self.method, policy, reshard, "bf16" if self.mixed_precision == "bf16" else "fp32"]
        return " ".join(parts + (["ac"] if self.activation_checkpointing else []))

#| export
def _lora_spec(spec:PlanSpec):
    "The QLoRASpec that builds this setting's LoRA or QLoRA model with fsdp_kit.qlora."
    from .qlora import QLoRASpec
    return QLoRASpec(model=spec.model, quant_storage="bfloat16", batch=spec.batch, seq_len=spec.seq_len, lora_r=spec.lora_r)

#| export
def _measure_lora(spec:PlanSpec, mesh, checkpoint:str):
    "A LoRA (bf16 base) or QLoRA (4-bit base) model from `checkpoint`, sharded per layer, one step measured."
    import torch, torch.distributed as dist
    from .qlora import load_lora_model, shard_lora_model, _quiet_libraries, _batch, _loss
    from .measure import measure_step
    _quiet_libraries()
    lspec = _lora_spec(spec)
    model = shard_lora_model(load_lora_model(checkpoint, lspec, quantized=spec.method == "qlora"), mesh, "bfloat16")
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = _batch(lspec, model.config.vocab_size, 0, dist.get_rank(), dist.get_world_size())
    def step():
        _loss(model, tokens, grad=True).backward()
        optim.step(); optim.zero_grad()
    m = measure_step(model, optim, step, timed_steps=1)
    del model, optim; gc.collect()
    return m

#| export
def _measure_full(spec:PlanSpec, mesh):
    "A full fine-tune of `spec.model` sharded as `spec` says, one step measured (the wrap lab's run_config)."
    from .wrap import CompareSpec, run_config
    r = run_config(spec.fsdp_config(), CompareSpec(model=spec.model, batch=spec.batch, seq_len=spec.seq_len, timed_steps=1), mesh)
    return r.peak_bytes, r.collectives

#| export
def validate_worker(specs:list) -> list:
    "Measure one training step of each spec on this process group (all of the same world size); rank 0's [(peak_bytes, collectives)]."
    import torch.distributed as dist
    from .mesh import build_mesh, fsdp_mesh
    from .qlora import _shared_tempdir
    mesh, out, checkpoints = fsdp_mesh(build_mesh()), [], {}
    try:
        for spec in specs:
            if spec.method == "full": out.append(_measure_full(spec, mesh)); continue
            if spec.model not in checkpoints:
                checkpoints[spec.model] = _shared_tempdir()
                if dist.get_rank() == 0: build_model(model_config(spec.model), 0).save_pretrained(checkpoints[spec.model])
                dist.barrier()
            m = _measure_lora(spec, mesh, checkpoints[spec.model])
            out.append((m.peak_bytes, m.collectives))
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            for path in checkpoints.values(): shutil.rmtree(path, ignore_errors=True)
    return out

#| export
@dataclass
class Tensor:
    "One parameter as FSDP2 sees it."
    name:str # qualified name
    shape:tuple # full shape (dim 0 is sharded)
    store:int # bytes per element of the sharded (stored) parameter
    gather:int # bytes per element when all-gathered (param_dtype)
    trainable:bool # has a gradient and optimizer state
    layer:int=-1 # decoder layer index, -1 outside the layers

    def numel(self) -> int: return math.prod(self.shape)
    def shard_numel(self, world:int) -> int: return -(self.shape[0] // -world) * (self.numel() // max(1, self.shape[0]))
    def padded_numel(self, world:int) -> int: return self.shard_numel(world) * world

#| export
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

def _layer_index(name:str) -> int:
    "The decoder layer a parameter name belongs to, or -1."
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1

def model_tensors(config, spec:PlanSpec) -> list:
    "Every parameter of `config`'s model under `spec.method`, from the meta device: shapes, stored and gathered bytes, trainable."
    meta = build_model(config, device="meta")
    base = 4 if spec.method == "full" else 2  # LoRA/QLoRA bases are loaded in bfloat16
    compute = 2 if spec.mixed_precision == "bf16" or spec.method != "full" else 4
    out = []
    for name, p in meta.named_parameters():
        shape, layer = tuple(p.shape), _layer_index(name)
        linear = layer >= 0 and name.split(".")[-2] in LINEARS
        if spec.method == "qlora" and linear: shape = (math.prod(shape) // 4, 1)  # 4-bit codes packed 4 per bfloat16 element
        out.append(Tensor(name, shape, base, compute, spec.method == "full", layer))
        if spec.method != "full" and linear:  # LoRA A (r x in) and B (out x r), kept in float32 by peft
            out += [Tensor(name.replace("weight", "lora_A"), (spec.lora_r, p.shape[1]), 4, compute, True, layer),
                    Tensor(name.replace("weight", "lora_B"), (p.shape[0], spec.lora_r), 4, compute, True, layer)]
    return out

#| export
def unit_of(t:Tensor, policy:str) -> str:
    "The FSDP unit holding `t`: 'root', 'layers.N', or a Linear's name under PER_LINEAR."
    if policy == "NO_WRAP": return "root"
    if policy == "PER_LINEAR":
        module = t.name.rsplit(".", 1)[0]
        return module.rsplit(".", 1)[0] if "lora_" in t.name else (module if module.split(".")[-1] in LINEARS + ("lm_head",) else "root")
    return f"layers.{t.layer}" if t.layer >= 0 else "root"

#| export
@dataclass
class Unit:
    "Bytes one FSDP unit holds and moves, on one rank."
    name:str
    sharded:int # its shard of the parameters, as stored
    unsharded:int # the gathered parameters (padded), in param_dtype
    grads:int # gradients while unsharded (trainable parameters, compute dtype)
    reduce:int # reduce-scatter input: padded trainable parameters in reduce_dtype (float32)
    sharded_grads:int # its shard of the gradients (float32)
    trainable_tensors:int # parameters with optimizer state
    largest_shard:int # bytes of its largest trainable parameter shard

def units(tensors:list, spec:PlanSpec) -> dict:
    "Unit name -> Unit for `spec` (forward order, the root first)."
    W, grad_b = spec.world_size, 2 if (spec.mixed_precision == "bf16" or spec.method != "full") else 4
    groups = {}
    for t in tensors: groups.setdefault(unit_of(t, spec.policy), []).append(t)
    order = ["root"] + [n for n in groups if n != "root"]
    out = {}
    for name in order:
        ts = groups.get(name, [])
        tr = [t for t in ts if t.trainable]
        out[name] = Unit(name, sum(t.shard_numel(W) * t.store for t in ts), sum(t.padded_numel(W) * t.gather for t in ts),
                         sum(t.numel() * grad_b for t in tr), sum(t.padded_numel(W) * 4 for t in tr),
                         sum(t.shard_numel(W) * 4 for t in tr), len(tr), max([t.shard_numel(W) * 4 for t in tr], default=0))
    return out

#| export
def dims(config, spec:PlanSpec) -> dict:
    "The sizes the activation formulas use: tokens per rank and the model's widths."
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    seq = spec.seq_len // spec.cp
    return dict(B=spec.batch, S=seq, T=spec.batch * seq, H=config.hidden_size, I=config.intermediate_size, V=config.vocab_size,
                L=config.num_hidden_layers, heads=heads, q=heads * head_dim, kv=config.num_key_value_heads * head_dim, head_dim=head_dim,
                b=2 if spec.mixed_precision == "bf16" or spec.method != "full" else 4, r=spec.lora_r, lora=spec.method != "full")

#| export
def activation_bytes(d:dict) -> dict:
    "Bytes saved for backward: per decoder layer, outside the layers, and the extra alive while the loss is computed."
    T, H, I, V, b = d["T"], d["H"], d["I"], d["V"], d["b"]
    frozen_norm = d["lora"]  # a frozen norm weight: mul(weight, x) keeps no copy of x
    norm = T * H * 4 + (1 if frozen_norm else 2) * T * H * b + T * 4  # float32 input, normalized (trainable weight), output, rsqrt
    attention = 2 * T * d["q"] * b + 2 * T * d["kv"] * b + d["B"] * d["heads"] * d["S"] * 4  # q after RoPE, output; k, v; logsumexp
    mlp = 4 * T * I * b  # gate out (SiLU input), SiLU out, up out, their product (down_proj input)
    lora = 7 * T * d["r"] * b if d["lora"] else 0  # lora_A's output, one per adapted Linear
    layer = 2 * norm + attention + mlp + lora
    final_norm = T * H * 4 + (0 if frozen_norm else 2 * T * H * b) + T * 4  # frozen weights (LoRA) keep neither normalized x nor lm_head's input
    rope = 2 * d["S"] * d["head_dim"] * b  # cos and sin, (1, S, head_dim), shared by every layer
    fixed = final_norm + T * V * 4 + rope + 8 * T + 8  # + log_softmax (float32), shifted labels (int64), loss scalars
    loss_extra = T * V * b + (T * V * 4 if b != 4 else 0) + 8 * (T + d["B"])  # logits, their float32 copy, padded labels
    return dict(layer=layer, fixed=fixed, final_norm=final_norm, recompute_extra=3 * T * H * b, loss_extra=loss_extra, checkpointed_layer=T * H * b, mlp_freed=T * I * b,
                mlp_temps=3 * T * I * b, grad_hidden=T * H * b, grad_logits=2 * T * V * 4)

#| export
def _sum(units_:list, key:str) -> int: return sum(getattr(u, key) for u in units_)

def _grad_bytes(tensors:list, test, b:int) -> int:
    "Unsharded gradient bytes of the trainable tensors passing `test`."
    return sum(t.numel() * b for t in tensors if t.trainable and test(t))

def moments(config, spec:PlanSpec) -> list:
    "The candidate peaks of one training step on one rank, each (name, {category: bytes})."
    tensors, d = model_tensors(config, spec), dims(config, spec)
    us, act, W, L = units(tensors, spec), activation_bytes(d), spec.world_size, d["L"]
    root, reshard = us["root"], spec.reshard_after_forward
    layer_units = [[u for n, u in us.items() if n != "root" and n.startswith(f"model.layers.{l}.") or n == f"layers.{l}"] for l in range(L)]
    others = [u for n, u in us.items() if n != "root" and not n.startswith("model.layers.") and not n.startswith("layers.")]  # lm_head under PER_LINEAR
    grad_b = d["b"]
    states = dict(sharded_params=_sum(us.values(), "sharded"), buffers=buffer_bytes(config),
                  optimizer_state=2 * _sum(us.values(), "sharded_grads") + 4 * _sum(us.values(), "trainable_tensors"))
    head = dict(unsharded_params=root.unsharded + _sum(others, "unsharded"))
    kept = lambda ls: sum(_sum(layer_units[l], "unsharded") for l in ls) if reshard is False else 0
    layer_act = act["checkpointed_layer"] if spec.activation_checkpointing else act["layer"]
    buffer = lambda u: u.unsharded if W > 1 else 0
    last = (layer_units[-1] or [root])[-1] if not others else others[-1]
    out = [("loss (end of forward)", dict(states, unsharded_params=head["unsharded_params"] + kept(range(L)), all_gather_buffers=buffer(last),
                                          activations=L * layer_act + act["fixed"] + act["loss_extra"] - 8))]
    again = reshard is not False and root.trainable_tensors > 0  # the root is gathered again for backward
    out.append(("loss backward", dict(states, unsharded_params=head["unsharded_params"] + kept(range(L)), all_gather_buffers=buffer(layer_units[-1][-1]) if reshard is not False and layer_units[-1] else 0,
                                      activations=L * layer_act + act["fixed"] - 8 * d["T"] - 4, temporaries=act["grad_logits"])))
    post_forward = lambda l: _sum(layer_units[l], "unsharded") // reshard if not isinstance(reshard, bool) else 0  # kept for backward, 1/N each
    if not isinstance(reshard, bool):
        out.append(("backward start", dict(states, unsharded_params=root.unsharded, all_gather_buffers=buffer(root), temporaries=_sum(layer_units[-1], "unsharded"),
                                           activations=L * layer_act + act["fixed"] + 4 + sum(post_forward(l) for l in range(L)))))
    carry = _grad_bytes(tensors, lambda t: t.layer < 0 and "embed_tokens" not in t.name and unit_of(t, spec.policy) == "root", grad_b)
    held = 0  # reduce-scatter input kept until the next unit's post-backward
    done_sharded_grads, done_unsharded_grads = 0, 0
    for j in reversed(range(L)):
        current = layer_units[j]
        down = _grad_bytes(tensors, lambda t: t.layer == j and ".down_proj." in t.name, grad_b)
        rope = 2 * d["S"] * d["head_dim"] * d["b"] + 8
        if spec.activation_checkpointing:  # recomputed tensors count as temporaries; the final norm's saved tensors stay
            activations = (j + 1) * layer_act + act["final_norm"] + rope
            recomputed = act["layer"] - act["mlp_freed"] - (layer_act if d["b"] == 4 else 0) + act["recompute_extra"]
        else: activations, recomputed = j * layer_act + act["layer"] - act["mlp_freed"] + rope, 0
        activations += sum(post_forward(l) for l in range(j + 1))
        temporaries = carry + done_unsharded_grads + act["grad_hidden"] + down + act["mlp_temps"] + recomputed + (held if W == 1 else 0)
        out.append((f"layer {j} backward (MLP)", dict(states, activations=activations, temporaries=temporaries,
                    reduce_scatter_buffers=held if W > 1 else 0, sharded_grads=done_sharded_grads,
                    unsharded_params=root.unsharded + _sum(current, "unsharded") + kept(range(j)),
                    all_gather_buffers=_sum(layer_units[j - 1], "unsharded") if W > 1 and j > 0 else 0)))
        if current: held, done_sharded_grads = _sum(current, "reduce"), done_sharded_grads + _sum(current, "sharded_grads")
        else: done_unsharded_grads += _grad_bytes(tensors, lambda t: t.layer == j, grad_b)
    largest = max(u.largest_shard for u in us.values())
    out.append(("optimizer step", dict(states, sharded_grads=_sum(us.values(), "sharded_grads"), temporaries=2 * largest)))
    return [(name, m | dict(total=sum(m.values()))) for name, m in out]

def buffer_bytes(config) -> int:
    "Bytes of the model's buffers (rotary frequencies), from the meta device."
    return sum(b.numel() * 4 for b in build_model(config, device="meta").buffers())

def predict_peak(config, spec:PlanSpec) -> tuple:
    "The largest of the candidate moments: (name, {category: bytes, total})."
    return max(moments(config, spec), key=lambda m: m[1]["total"])

#| export
def predict_comm(config, spec:PlanSpec) -> dict:
    "All-gather and reduce-scatter calls and bytes of one step on one rank (each collective's full, padded buffer)."
    if spec.world_size == 1: return {}
    us = units(model_tensors(config, spec), spec).values()
    again = lambda u: spec.reshard_after_forward is not False and (u.name != "root" or u.trainable_tensors > 0)
    gathers = [(1 + again(u), u.unsharded) for u in us if u.unsharded]
    scatters = [u.reduce for u in us if u.reduce]
    return dict(all_gather=dict(count=sum(n for n, _ in gathers), bytes=sum(n * b for n, b in gathers)),
                reduce_scatter=dict(count=len(scatters), bytes=sum(scatters)))
