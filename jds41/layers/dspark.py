"""The DSpark draft block: proposes `block_size` tokens after the last one in one parallel pass (MODEL.md §4).

Owns the drafter's math, its parameters (the `mtp.{s}.*` tensors of checkpoints/schema.draft_tensors, from the
target file or a separate draft file) and its state. The target model supplies, per committed token, its target
features: the block input of the DSpark target layers averaged over the hc copies (model.step's
`feature_layers` output), [n_targets, D].

- Injection (`inject`, once per committed position p): main_x = main_norm(main_proj(concat features)) (stage 0's
  projection, n_targets*D -> D); every stage s writes kv_norm(wkv_s(main_x)), rotated at p like any ratio-0
  latent (attention.latent), into its own window ring. Only committed (verified and accepted) positions are ever
  injected, so the drafter never rolls back.
- Drafting (`propose`): the block [last, noise x (B-1)] at positions p .. p+B-1 is embedded (shared embedding)
  and expanded to the hc copies. Each stage is a full ratio-0 block: hc_pre, attention, hc_post, hc_pre, MoE over
  the draft's own experts (bias routing, never hashed), hc_post. Its attention is non-causal within the block:
  every block row attends to the stage's injected window rows plus all B block rows (their own latents), with
  the sink. The last stage collapses with its own hc_head, `norm`, and the shared output head: B logit rows.
- Markov head (sequential over the block): logits_i += markov_head @ markov_embd[tok_i] with tok_0 = last and
  tok_{i+1} = argmax(logits_i) (greedy; speculative.py verifies greedily).
- Confidence head: sigmoid(conf_proj . [hidden_i ; markov_embd[tok_i]]) per position (hidden_i = the normed row
  the output head reads); callers may cut the draft at the first position below a threshold.

The draft's arithmetic need not match anything bit for bit (the target verifies every token), so rows are simply
vmapped. Draft rows and injected rows use the ratio-0 RoPE of their block index (base rope_freq_base, no YaRN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jds41.checkpoints.schema import Kind, draft_expert_counts, draft_stages, draft_tensors
from jds41.config import ModelConfig
from jds41.errors import ModelFileError
from jds41.layers import attention
from jds41.layers.mhc import hc_collapse, hc_expand, hc_head, hc_mix, hc_split
from jds41.layers.moe import routed_experts, shared_expert
from jds41.layers.norm import rms_norm
from jds41.layers.rope import layer_rope_freqs
from jds41.layers.router import route
from jds41.quant import QTensor, qmatvec


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """Static description of a drafter (hashable: the jitted functions' static argument)."""

    cfg: ModelConfig  # the config with the draft stages (the target's keys + DSpark keys + nextn stages)
    n_stages: int
    moe_cfg: ModelConfig  # cfg with the draft's expert count / top-k, for the router

    @property
    def block_size(self) -> int:
        return self.cfg.dspark.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.dspark.target_layer_ids

    def layer(self, stage: int) -> int:
        """Block index of a stage (its swiglu clamp and ratio-0 RoPE come from there)."""
        return self.cfg.n_layers + stage


def make_draft_plan(cfg: ModelConfig) -> DraftPlan:
    n = draft_stages(cfg)
    if not n:
        raise ValueError("the config has no DSpark draft stages (DSpark keys and nextn_predict_layers > 0)")
    experts, used = draft_expert_counts(cfg)
    return DraftPlan(cfg=cfg, n_stages=n, moe_cfg=dataclasses.replace(cfg, n_experts=experts, n_experts_used=used))


def load_draft_params(cfg: ModelConfig, model, act_round: str | None = None) -> dict:
    """{"stages": [{short name: leaf}]} from a GGUFModel holding the `mtp.*` tensors (a target file with draft
    stages or a separate draft file). Matrices stay quantized (QTensor); vectors and small matrices are f32."""
    stages: list[dict] = [{} for _ in range(draft_stages(cfg))]
    for name, spec in draft_tensors(cfg).items():
        info = model.tensors.get(name)
        if info is None:
            raise ModelFileError(model.path, "draft tensor missing", tensor=name)
        stage = spec.layer - cfg.n_layers
        short = name[len(f"mtp.{stage}."):].rsplit(".", 1)[0]
        if spec.kind in (Kind.MATRIX, Kind.EXPERTS):
            leaf = QTensor.from_raw(model.raw(name), info.ggml_type, spec.shape, act_round)
        else:
            leaf = jnp.asarray(model.typed(name).reshape(spec.shape), jnp.float32)
        stages[stage][short] = leaf
    return jax.device_put({"stages": stages})


def init_draft_state(plan: DraftPlan) -> dict:
    """One window ring of injected feature KV per stage."""
    return {"rings": [attention.init_ring(plan.cfg) for _ in range(plan.n_stages)]}


def _freqs(plan: DraftPlan, stage: int) -> jax.Array:
    return jnp.asarray(layer_rope_freqs(plan.cfg, plan.layer(stage)))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def inject(plan: DraftPlan, params: dict, state: dict, features: jax.Array, pos0: jax.Array,
           count: jax.Array) -> dict:
    """Write the feature KV of committed positions pos0 .. pos0+count-1 into every stage's ring.

    `features` [N, n_targets, D] (rows i >= count are ignored, so one compiled program serves every count <= N).
    """
    cfg = plan.cfg
    w0 = params["stages"][0]

    def body(rings, xs):
        i, f = xs
        pos = pos0 + i
        main_x = rms_norm(qmatvec(f.reshape(-1), w0["main_proj"]), w0["main_norm"], cfg.rms_eps)
        new = []
        for s, ring in enumerate(rings):
            kv = attention.latent(cfg, params["stages"][s], main_x, pos, _freqs(plan, s))
            pushed = attention.push_ring(ring, kv, pos)
            new.append(jax.tree.map(lambda a, b: jnp.where(i < count, a, b), pushed, ring))
        return new, None

    n = features.shape[0]
    rings, _ = jax.lax.scan(body, state["rings"], (jnp.arange(n, dtype=jnp.int32), features.astype(jnp.float32)))
    return {"rings": rings}


def _mix(cfg: ModelConfig, w: dict, branch: str, x_BHD):
    mix = jax.vmap(lambda x: hc_mix(x, w[f"hc_{branch}_fn"], cfg.rms_eps))(x_BHD)
    return hc_split(mix, w[f"hc_{branch}_scale"], w[f"hc_{branch}_base"], cfg.hc_eps, cfg.hc_sinkhorn_iters)


def _stage(plan: DraftPlan, s: int, w: dict, ring: dict, x_BHD, pos_B):
    """One draft stage over the B block rows: [B, hc, D] -> [B, hc, D]."""
    cfg, freqs = plan.cfg, _freqs(plan, s)
    pre, post, comb = _mix(cfg, w, "attn", x_BHD)
    h = rms_norm(hc_collapse(x_BHD, pre), w["attn_norm"], cfg.rms_eps)
    q, _ = jax.vmap(lambda h_D: attention.query(cfg, w, h_D))(h)
    kv_blk = jax.vmap(lambda h_D, p: attention.latent(cfg, w, h_D, p, freqs))(h, pos_B)
    # Non-causal block: every row sees the injected window rows and all B block rows.
    keys = jnp.concatenate([ring["kv"], kv_blk])
    valid = jnp.concatenate([ring["pos"] >= 0, jnp.ones((kv_blk.shape[0],), bool)])
    o = jax.vmap(lambda q_HK, p: attention.attend(cfg, w, q_HK, keys, valid, p, freqs))(q, pos_B)
    out = jax.vmap(lambda o_HK: attention.output(cfg, w, o_HK))(o)
    x_BHD = hc_expand(x_BHD, out, post, comb)

    pre, post, comb = _mix(cfg, w, "ffn", x_BHD)
    h = rms_norm(hc_collapse(x_BHD, pre), w["ffn_norm"], cfg.rms_eps)
    limit = cfg.swiglu_limit[plan.layer(s)]

    def ffn(h_D):
        r = route(h_D, w["ffn_gate_inp"], w["exp_probs_b"], plan.moe_cfg)
        y = routed_experts(h_D, w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"], r.idx_K, r.weight_K, limit)
        if cfg.n_shared_experts:
            y = y + shared_expert(h_D, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"],
                                  cfg.swiglu_limit_shexp[plan.layer(s)])
        return y

    return hc_expand(x_BHD, jax.vmap(ffn)(h), post, comb)


@functools.partial(jax.jit, static_argnums=0)
def propose(plan: DraftPlan, params: dict, shared: dict, state: dict, last_token: jax.Array,
            pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draft B tokens after `last_token` (which sits at position `pos`): (tokens [B] int32, confidence [B],
    logits [B, V] with the Markov term). `shared` holds the target's `token_embd` and `output` (QTensors)."""
    from jds41.model import embed  # the target's one-row embedding lookup

    cfg, B = plan.cfg, plan.block_size
    ids = jnp.concatenate([jnp.reshape(last_token, (1,)).astype(jnp.int32),
                           jnp.full((B - 1,), cfg.dspark.noise_token_id, jnp.int32)])
    pos_B = pos + jnp.arange(B, dtype=jnp.int32)
    e = jax.vmap(lambda t: embed(shared["token_embd"], t))(ids)
    x = jnp.broadcast_to(e[:, None, :], (B, cfg.hc_mult, cfg.dim))
    for s in range(plan.n_stages):
        x = _stage(plan, s, params["stages"][s], state["rings"][s], x, pos_B)
    w = params["stages"][-1]
    y = jax.vmap(lambda x_HD: hc_head(x_HD, w["hc_head_fn"], w["hc_head_scale"], w["hc_head_base"], cfg.hc_eps,
                                      cfg.rms_eps))(x)
    hidden = rms_norm(y, w["norm"], cfg.rms_eps)
    base_logits = jax.vmap(lambda h_D: qmatvec(h_D, shared["output"]))(hidden)
    tok = ids[0]
    tokens, conf, logits = [], [], []
    for i in range(B):  # Markov head: sequential, each row conditioned on the previous draft token
        m = w["markov_embd"][tok]
        row = base_logits[i] + w["markov_head"] @ m
        conf.append(jax.nn.sigmoid(jnp.dot(w["conf_proj"][0], jnp.concatenate([hidden[i], m]))))
        tok = jnp.argmax(row).astype(jnp.int32)
        tokens.append(tok)
        logits.append(row)
    return jnp.stack(tokens), jnp.stack(conf), jnp.stack(logits)
