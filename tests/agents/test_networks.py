"""Tests of the policy network: shapes, padding masks, group pooling, Transformer-XL relative
attention (causality, segment recurrence, relative positions), the masked distribution, settings."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical

from agents.networks import (
    GATEncoder,
    MaskedCategorical,
    PolicyConfig,
    PolicyError,
    RelativeMultiHeadAttention,
    StrategyPolicy,
    TransformerXL,
    most_likely_actions,
    sinusoid_embedding,
)
from heterog.errors import HeterogError

F_OP, F_DEV, M = 6, 3, 3
N_ACTIONS = M + 4


def make_graph(n_ops: int = 12, n_edges: int = 20, n_groups: int = 5,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """A random unpadded observation; every group has at least one op."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, n_groups, (n_ops - n_groups,), generator=gen)
    group_of = torch.cat([torch.arange(n_groups), extra])
    return {
        "op_x": torch.randn(n_ops, F_OP, generator=gen),
        "op_mask": torch.ones(n_ops, dtype=torch.bool),
        "edge_index": torch.randint(0, n_ops, (2, n_edges), generator=gen),
        "edge_mask": torch.ones(n_edges, dtype=torch.bool),
        "group_of": group_of,
        "group_mask": torch.ones(n_groups, dtype=torch.bool),
        "dev_x": torch.randn(M, F_DEV, generator=gen),
    }


def pad_graph(obs: dict[str, torch.Tensor], extra_ops: int, extra_edges: int, extra_groups: int,
              seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pad as an env might (garbage features, padding edges to op 0 interleaved with real ones), with
    padding groups interleaved between real ones. Returns the padded observation and the new id of
    each real group."""
    gen = torch.Generator().manual_seed(seed)
    n_ops, n_groups = obs["op_x"].shape[0], obs["group_mask"].shape[0]
    total_groups = n_groups + extra_groups
    new_id = torch.randperm(total_groups, generator=gen)[:n_groups].sort().values
    group_mask = torch.zeros(total_groups, dtype=torch.bool)
    group_mask[new_id] = True
    pad_edges = torch.stack([torch.zeros(extra_edges, dtype=torch.long),
                             torch.randint(0, n_ops + extra_ops, (extra_edges,), generator=gen)])
    edge_index = torch.cat([obs["edge_index"], pad_edges], dim=1)
    edge_mask = torch.cat([obs["edge_mask"], torch.zeros(extra_edges, dtype=torch.bool)])
    order = torch.randperm(edge_index.shape[1], generator=gen)
    padded = {
        "op_x": torch.cat([obs["op_x"], 100 * torch.randn(extra_ops, F_OP, generator=gen)]),
        "op_mask": torch.cat([obs["op_mask"], torch.zeros(extra_ops, dtype=torch.bool)]),
        "edge_index": edge_index[:, order],
        "edge_mask": edge_mask[order],
        "group_of": torch.cat([new_id[obs["group_of"]], torch.full((extra_ops,), -1)]),
        "group_mask": group_mask,
        "dev_x": obs["dev_x"],
    }
    return padded, new_id


def small_policy(seed: int = 0, **overrides) -> StrategyPolicy:
    torch.manual_seed(seed)
    settings = {"hidden": 16, "gat_layers": 2, "gat_heads": 2, "txl_layers": 2, "txl_heads": 2,
                "segment_len": 3, "mem_len": 64}
    return StrategyPolicy(PolicyConfig(F_OP, F_DEV, N_ACTIONS, **{**settings, **overrides}))


def with_settings(policy: StrategyPolicy, **changes) -> StrategyPolicy:
    """The same weights under other (weight-free) settings such as segment_len or mem_len."""
    other = StrategyPolicy.from_config({**policy.config, **changes})
    other.load_state_dict(policy.state_dict())
    return other.eval()


# ----------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("gat_conv", ["gat", "gatv2"])
@pytest.mark.parametrize("group_activation", ["sigmoid", "tanh"])
def test_logits_shape_and_zero_padding_rows(gat_conv: str, group_activation: str) -> None:
    policy = small_policy(gat_conv=gat_conv, group_activation=group_activation)
    padded, _ = pad_graph(make_graph(), extra_ops=5, extra_edges=7, extra_groups=4)
    logits = policy(**padded)
    assert logits.shape == (9, N_ACTIONS) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert (logits[~padded["group_mask"]] == 0).all()
    assert policy.embed_groups(**padded).shape == (9, 16)


def test_padding_ops_edges_and_groups_do_not_change_real_logits() -> None:
    policy = small_policy().eval()
    obs = make_graph(n_ops=15, n_edges=30, n_groups=7)
    padded, new_id = pad_graph(obs, extra_ops=6, extra_edges=11, extra_groups=5)
    torch.testing.assert_close(policy(**padded)[new_id], policy(**obs), rtol=1e-5, atol=1e-6)


def test_same_seed_same_policy_and_config_round_trip() -> None:
    obs = make_graph()
    a, b = small_policy(seed=3), small_policy(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a(**obs), b(**obs))
    rebuilt = with_settings(a)
    assert rebuilt.config == a.config and rebuilt.n_actions == N_ACTIONS and rebuilt.n_devices == M
    assert torch.equal(rebuilt(**obs), a(**obs))


def test_initial_policy_is_near_uniform() -> None:
    dist = small_policy().distribution(**make_graph())
    assert dist.entropy().item() == pytest.approx(math.log(N_ACTIONS), abs=1e-2)


# ---------------------------------------------------------------------------------- group pooling
@pytest.mark.parametrize("activation, sigma", [("sigmoid", torch.sigmoid), ("tanh", torch.tanh)])
def test_group_embedding_is_sigma_of_summed_projection(activation: str, sigma) -> None:
    policy = small_policy(group_activation=activation)
    # ops 0..3 real, op 4 padding (its group id 0 must be ignored); groups 0, 1, 3 real, 2 padding;
    # group 3 has no ops.
    obs = {
        "op_x": torch.randn(5, F_OP), "op_mask": torch.tensor([True, True, True, True, False]),
        "edge_index": torch.tensor([[0, 1, 2, 0], [1, 2, 3, 4]]),
        "edge_mask": torch.tensor([True, True, True, False]),
        "group_of": torch.tensor([0, 1, 0, 1, 0]), "group_mask": torch.tensor([True, True, False, True]),
        "dev_x": torch.randn(M, F_DEV)}
    e = policy.encode_ops(obs["op_x"], obs["op_mask"], obs["edge_index"], obs["edge_mask"], obs["dev_x"])
    w = policy.pooling.weight.weight
    expected = torch.stack([sigma(w @ (e[0] + e[2])), sigma(w @ (e[1] + e[3])), torch.zeros(16),
                            sigma(torch.zeros(16))])
    torch.testing.assert_close(policy.embed_groups(**obs), expected)


def test_gat_encoder_uses_edges_both_ways_and_drops_padding_edges() -> None:
    torch.manual_seed(0)
    encoder = GATEncoder(F_OP, F_DEV, hidden=8, layers=1, heads=2)
    op_x, dev_x = torch.randn(3, F_OP), torch.randn(M, F_DEV)
    mask = torch.ones(3, dtype=torch.bool)
    forward = encoder(op_x, mask, torch.tensor([[0], [1]]), torch.tensor([True]), dev_x)
    backward = encoder(op_x, mask, torch.tensor([[1], [0]]), torch.tensor([True]), dev_x)
    torch.testing.assert_close(forward, backward)            # direction does not matter
    alone = encoder(op_x, mask, torch.tensor([[0], [1]]), torch.tensor([False]), dev_x)
    assert not torch.allclose(alone[1], forward[1])           # the real edge carries messages ...
    torch.testing.assert_close(alone[2], forward[2])          # ... and only to its endpoints
    torch.testing.assert_close(alone, encoder(op_x, mask, torch.zeros(2, 0, dtype=torch.long),
                                              torch.zeros(0, dtype=torch.bool), dev_x))


# --------------------------------------------------------------------------------- Transformer-XL
@pytest.mark.parametrize("segment_len, mem_len", [(3, 4), (3, 0), (4, 64), (10, 0)])
def test_transformer_xl_is_causal_within_and_across_segments(segment_len: int, mem_len: int) -> None:
    torch.manual_seed(0)
    txl = TransformerXL(hidden=16, layers=2, heads=2, segment_len=segment_len, mem_len=mem_len)
    x = torch.randn(10, 16)
    out = txl(x)
    for j in range(10):
        changed = x.clone()
        changed[j] += torch.randn(16)
        out_changed = txl(changed)
        torch.testing.assert_close(out_changed[:j], out[:j], rtol=0, atol=1e-6)
        assert not torch.allclose(out_changed[j], out[j])


def test_policy_logits_of_a_group_ignore_later_groups() -> None:
    policy = small_policy()
    group_mask = torch.tensor([True, False, True, True, True, False, True, True])
    group_emb = torch.rand(8, 16)
    logits = policy.logits_from_group_embeddings(group_emb, group_mask)
    for j in group_mask.nonzero().squeeze(1).tolist():
        changed = group_emb.clone()
        changed[j] = torch.rand(16)
        torch.testing.assert_close(policy.logits_from_group_embeddings(changed, group_mask)[:j], logits[:j],
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("segment_len", [1, 3, 4, 7])
def test_segments_with_full_memory_equal_one_segment(segment_len: int) -> None:
    policy = small_policy(segment_len=segment_len, mem_len=64).eval()
    obs = make_graph(n_ops=30, n_edges=50, n_groups=11)
    one_segment = with_settings(policy, segment_len=64)
    torch.testing.assert_close(policy(**obs), one_segment(**obs), rtol=1e-5, atol=1e-6)
    short_memory = with_settings(policy, mem_len=1)
    if segment_len < 11:
        assert not torch.allclose(short_memory(**obs), one_segment(**obs), atol=1e-4)


@pytest.mark.parametrize("segment_len, mem_len", [(3, 4), (3, 0), (4, 64), (1, 2), (10, 0)])
def test_transformer_xl_batches_and_decodes_step_by_step_as_forward(segment_len: int, mem_len: int) -> None:
    torch.manual_seed(0)
    txl = TransformerXL(hidden=16, layers=2, heads=2, segment_len=segment_len, mem_len=mem_len)
    x = torch.randn(3, 10, 16)
    batched = txl(x)
    for b in range(3):                                          # a batch is independent sequences
        torch.testing.assert_close(batched[b], txl(x[b]), rtol=1e-5, atol=1e-6)
    state = txl.start_decoding(3, x)
    stepped = torch.stack([txl.decode_step(state, x[:, s]) for s in range(10)], dim=1)
    torch.testing.assert_close(stepped, batched, rtol=1e-5, atol=1e-6)


def test_autoregressive_policy_conditions_each_group_on_earlier_actions_only() -> None:
    policy = small_policy(autoregressive=True).eval()
    group_mask = torch.tensor([True, False, True, True, True, False, True, True])
    real = group_mask.nonzero().squeeze(1)
    group_emb = torch.rand(8, 16)
    actions = torch.randint(0, N_ACTIONS, (2, 8)) * group_mask
    logits = policy.action_logits(group_emb, group_mask, actions)
    assert logits.shape == (2, 8, N_ACTIONS) and (logits[:, ~group_mask] == 0).all()
    for k, g in enumerate(real.tolist()):
        changed = actions.clone()
        changed[0, g] = (changed[0, g] + 1) % N_ACTIONS
        after = policy.action_logits(group_emb, group_mask, changed)
        torch.testing.assert_close(after[1], logits[1])                       # strategies are independent
        torch.testing.assert_close(after[0, real[:k + 1]], logits[0, real[:k + 1]], rtol=0, atol=1e-6)
        if k + 1 < len(real):                                                 # later groups see it
            assert not torch.allclose(after[0, real[k + 1:]], logits[0, real[k + 1:]], atol=1e-6)
    with pytest.raises(PolicyError, match="autoregressive"):
        policy(**make_graph())
    with pytest.raises(PolicyError, match="autoregressive"):
        policy.distribution(**make_graph())


@pytest.mark.parametrize("autoregressive", [False, True])
def test_decoded_strategies_follow_the_logits_along_them(autoregressive: bool) -> None:
    policy = small_policy(autoregressive=autoregressive, segment_len=2, mem_len=3).eval()
    padded, new_id = pad_graph(make_graph(n_ops=20, n_edges=30, n_groups=7), extra_ops=3, extra_edges=4,
                               extra_groups=3)
    mask = padded["group_mask"]
    with torch.no_grad():
        policy.head.weight.mul_(1000.0)                          # a peaked policy, so draws are telling
        group_emb = policy.embed_groups(**padded)
        greedy = policy.sample_actions(group_emb, mask, 2, greedy=True)
        assert (greedy[:, ~mask] == 0).all() and torch.equal(greedy[0], greedy[1])
        along = policy.action_logits(group_emb, mask, greedy)
        assert torch.equal(most_likely_actions(along[0, new_id]), greedy[0, new_id])   # greedy along itself
        gen = torch.Generator().manual_seed(5)
        drawn = policy.sample_actions(group_emb, mask, 200, generator=gen)
        assert torch.equal(drawn, policy.sample_actions(group_emb, mask, 200, generator=gen.manual_seed(5)))
        assert (drawn[:, ~mask] == 0).all()
        log_p = policy.action_logits(group_emb, mask, drawn).log_softmax(-1)
        picked = log_p.gather(-1, drawn[..., None])[..., 0][:, new_id]
        # draws come from the logits along them: the mean log probability of the drawn actions is minus the
        # mean entropy (E[log p(a)] = -H), which actions drawn from another distribution fall short of
        entropy = -(log_p.exp() * log_p).sum(-1)[:, new_id].mean()
        shifted = log_p.gather(-1, ((drawn + 1) % N_ACTIONS)[..., None])[..., 0][:, new_id]
        assert float(picked.mean()) == pytest.approx(-float(entropy), abs=0.1)
        assert float(shifted.mean()) < -float(entropy) - 0.5


def test_draw_from_precomputed_logits_equals_sample_actions() -> None:
    policy = small_policy().eval()
    padded, _ = pad_graph(make_graph(n_ops=20, n_edges=30, n_groups=7), extra_ops=3, extra_edges=4, extra_groups=3)
    mask = padded["group_mask"]
    with torch.no_grad():
        group_emb = policy.embed_groups(**padded)
        logits = policy.logits_from_group_embeddings(group_emb, mask)
        offsets = torch.randn(5, N_ACTIONS, generator=torch.Generator().manual_seed(1))
        for how in ({"offsets": offsets}, {}, {"greedy": True}):
            a = policy.sample_actions(group_emb, mask, 5, generator=torch.Generator().manual_seed(7), **how)
            b = policy.draw(logits, mask, 5, generator=torch.Generator().manual_seed(7), **how)
            assert torch.equal(a, b) and (b[:, ~mask] == 0).all()
        assert policy.draw(None, mask, 0).shape == (0, mask.shape[0])
    with pytest.raises(HeterogError, match="autoregressive"):
        small_policy(autoregressive=True).draw(logits, mask, 1)


def naive_relative_attention(attn: RelativeMultiHeadAttention, x: torch.Tensor,
                             mem: torch.Tensor) -> torch.Tensor:
    """Transformer-XL's score written out per (head, query, key), with sinusoids from math.sin/cos."""
    hidden, heads, d = attn.hidden, attn.heads, attn.head_dim
    context = torch.cat([mem, x])
    m = mem.shape[0]
    w_q = attn.q_net.weight
    w_k, w_v = attn.kv_net.weight[:hidden], attn.kv_net.weight[hidden:]
    w_r, w_o = attn.r_net.weight, attn.o_net.weight

    def sinusoid(distance: int) -> torch.Tensor:
        freqs = [1.0 / 10000 ** (2 * k / hidden) for k in range(hidden // 2)]
        return torch.tensor([math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs])

    out = torch.zeros(x.shape[0], hidden)
    for i in range(x.shape[0]):
        q = (w_q @ x[i]).view(heads, d)
        for h in range(heads):
            scores, values = [], []
            for j in range(m + i + 1):                       # keys up to the query's own position
                k = (w_k @ context[j]).view(heads, d)[h]
                r = (w_r @ sinusoid(m + i - j)).view(heads, d)[h]
                scores.append(((q[h] + attn.u[h]) @ k + (q[h] + attn.v[h]) @ r) / math.sqrt(d))
                values.append((w_v @ context[j]).view(heads, d)[h])
            weights = torch.softmax(torch.stack(scores), dim=0)
            out[i, h * d:(h + 1) * d] = weights @ torch.stack(values)
    return out @ w_o.T


def test_relative_attention_matches_naive_computation() -> None:
    torch.manual_seed(0)
    attn = RelativeMultiHeadAttention(hidden=8, heads=2)
    with torch.no_grad():
        attn.u.normal_()
        attn.v.normal_()
    x, mem = torch.randn(3, 8), torch.randn(2, 8)
    pos_emb = sinusoid_embedding(torch.arange(5), 8)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, torch.cat([mem, x]), pos_emb),
                                   naive_relative_attention(attn, x, mem))
        torch.testing.assert_close(attn(x, x, pos_emb[:3]), naive_relative_attention(attn, x, mem[:0]))


def test_relative_position_term_matches_transformer_xl_rel_shift() -> None:
    """The explicit gather equals the paper's pad-and-reshape rel_shift on the visible (causal) part."""
    torch.manual_seed(0)
    q_len, m, heads, d = 4, 3, 2, 5
    k_len = q_len + m
    q, r = torch.randn(q_len, heads, d), torch.randn(k_len, heads, d)    # r row k = distance k
    by_distance = torch.einsum("ihd,khd->hik", q, r)
    distance = torch.arange(q_len)[:, None] + m - torch.arange(k_len)[None, :]
    gathered = by_distance.gather(2, distance.clamp(min=0).expand(heads, q_len, k_len))
    # Transformer-XL: positions in descending order (k_len-1 .. 0), then rel_shift.
    bd = torch.einsum("ihd,khd->ikh", q, r.flip(0))                       # (q_len, k_len, heads)
    padded = torch.cat([bd.new_zeros(q_len, 1, heads), bd], dim=1).view(k_len + 1, q_len, heads)
    shifted = padded[1:].view(q_len, k_len, heads).permute(2, 0, 1)
    visible = distance >= 0
    torch.testing.assert_close(gathered[:, visible], shifted[:, visible])


# ---------------------------------------------------------------------------------- distribution
def test_most_likely_actions_weigh_model_parallelism_as_one_decision() -> None:
    """Columns: 3 devices, then the 4 DP schemes. Row 0: the devices hold 0.65 between them, cp-ar 0.35
    (the argmax): model parallelism wins and takes its most likely device. Row 1: one DP scheme at 0.8
    wins. Row 2: model parallelism at 0.45 against ev-ps at 0.55: ev-ps, although a device holds 0.3."""
    p = torch.tensor([[0.2, 0.25, 0.2, 0.0, 0.0, 0.0, 0.35],
                      [0.1, 0.05, 0.05, 0.0, 0.8, 0.0, 0.0],
                      [0.3, 0.15, 0.0, 0.55, 0.0, 0.0, 0.0]]).clamp(min=1e-9).log()
    assert most_likely_actions(p).tolist() == [1, 4, 3] and p[0].argmax().item() == 6
    assert most_likely_actions(p[None]).tolist() == [[1, 4, 3]]


def test_masked_categorical_ignores_padding_groups() -> None:
    logits = torch.randn(5, N_ACTIONS)
    mask = torch.tensor([True, False, True, True, False])
    dist = MaskedCategorical(logits, mask)
    real = Categorical(logits=logits[mask])
    actions = torch.tensor([[1, -1, 2, 6, 99], [0, 3, 0, 0, 5]])          # padding entries are garbage
    expected = torch.stack([real.log_prob(a[mask]).sum() for a in actions])
    torch.testing.assert_close(dist.log_prob(actions), expected)
    torch.testing.assert_close(dist.entropy(), real.entropy().mean())
    assert dist.n_real == 3 and dist.mode[~mask].eq(0).all()
    assert dist.mode[mask].equal(most_likely_actions(logits[mask]))
    with pytest.raises(PolicyError, match="action 7 of group 2 is out of range 0..6"):
        dist.log_prob(torch.tensor([0, 0, 7, 0, 0]))


def test_sampling_is_reproducible_and_follows_the_probabilities() -> None:
    logits = torch.randn(4, N_ACTIONS)
    mask = torch.tensor([True, True, False, True])
    dist = MaskedCategorical(logits, mask)
    first = dist.sample(5000, generator=torch.Generator().manual_seed(7))
    again = dist.sample(5000, generator=torch.Generator().manual_seed(7))
    assert first.shape == (5000, 4) and first.dtype == torch.long and torch.equal(first, again)
    assert (first[:, 2] == 0).all()
    frequencies = torch.stack([torch.bincount(first[:, g], minlength=N_ACTIONS) for g in (0, 1, 3)]) / 5000
    torch.testing.assert_close(frequencies, dist.probs[mask], rtol=0, atol=0.03)
    unpadded = MaskedCategorical(logits[mask], torch.ones(3, dtype=torch.bool))
    assert torch.equal(unpadded.sample(5000, generator=torch.Generator().manual_seed(7)), first[:, mask])
    assert dist.sample().shape == (4,)


def test_gradients_reach_every_parameter() -> None:
    """Through the log probability and entropy of whole plans (configs, recompute bits, micro-batches)."""
    policy = small_policy(segment_len=2, mem_len=3)
    padded, _ = pad_graph(make_graph(), extra_ops=3, extra_edges=4, extra_groups=2)
    dist = policy.plan_distribution(**padded)
    actions = dist.sample(4, generator=torch.Generator().manual_seed(0))
    (-dist.log_prob(actions).mean() - 0.1 * dist.entropy()).backward()
    for name, parameter in policy.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


# -------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("overrides, message", [
    ({"hidden": 100, "gat_heads": 8}, "hidden size 100 is not divisible by 8 GAT heads"),
    ({"hidden": 36, "gat_heads": 4, "txl_heads": 8},
     "hidden size 36 is not divisible by 8 Transformer-XL heads"),
    ({"hidden": 9, "gat_heads": 3, "txl_heads": 1}, "hidden size 9 must be even"),
    ({"segment_len": 0}, "segment_len must be at least 1, got 0"),
    ({"mem_len": -1}, "mem_len must be at least 0, got -1"),
    ({"gat_layers": 0}, "GAT layers must be at least 1"),
    ({"txl_layers": 0}, "Transformer-XL layers must be at least 1"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"gat_conv": "gcn"}, "unknown GAT conv 'gcn'"),
    ({"group_activation": "relu"}, "unknown group activation 'relu'"),
    ({"n_actions": 4}, "n_actions must be M \\+ 4 for M >= 1 devices, got 4"),
])
def test_bad_settings_are_rejected(overrides: dict, message: str) -> None:
    settings = {"op_feature_dim": F_OP, "device_feature_dim": F_DEV, "n_actions": N_ACTIONS, **overrides}
    with pytest.raises(ValueError, match=message) as raised:
        PolicyConfig(**settings)
    assert isinstance(raised.value, HeterogError)


def test_bad_inputs_are_rejected() -> None:
    policy = small_policy()
    obs = make_graph()
    with pytest.raises(PolicyError, match="dev_x has 5 devices, so 9 actions; this policy has 7"):
        policy(**{**obs, "dev_x": torch.randn(5, F_DEV)})
    op_mask = obs["op_mask"].clone()
    op_mask[obs["edge_index"][1, 0]] = False
    with pytest.raises(PolicyError, match="touches a padding op"):
        policy(**{**obs, "op_mask": op_mask})
    group_mask = obs["group_mask"].clone()
    group_mask[2] = False
    with pytest.raises(PolicyError, match="is in group 2, which is not a real group"):
        policy(**{**obs, "group_mask": group_mask})
    with pytest.raises(PolicyError, match="op_x must be"):
        policy(**{**obs, "op_x": torch.randn(12, F_OP + 1)})


def test_presets_and_repr() -> None:
    small = StrategyPolicy.small(F_OP, F_DEV, N_ACTIONS)
    assert (small.config["hidden"], small.config["gat_layers"], small.config["txl_layers"]) == (64, 2, 2)
    paper = StrategyPolicy.paper(F_OP, F_DEV, N_ACTIONS, mem_len=32)
    assert (paper.config["gat_layers"], paper.config["gat_heads"], paper.config["txl_layers"]) == (12, 8, 8)
    assert paper.config["mem_len"] == 32
    assert len(paper.encoder.convs) == 12 and len(paper.strategy.blocks) == 8
    text = repr(small)
    assert "hidden=64" in text and "gat=2x4 heads" in text and "params=" in text
    assert repr(small.strategy.blocks[0].attn) == "RelativeMultiHeadAttention(64, heads=4, dropout=0.0)"
