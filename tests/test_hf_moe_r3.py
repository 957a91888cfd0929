"""R3 on a real transformers MoE model: trajstore.integrations.hf_moe.

Tiny models built from configs here (2 layers, hidden 64, 8 experts, top-2),
nothing downloaded. Every expected route is recomputed in the test itself
from what the router module received (softmax + top-k of ``x @ W.T``), never
taken from the hooks under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from trajstore.cli import main as cli_main
from trajstore.integrations.hf_moe import (
    UnsupportedMoEModel,
    generate_with_routes,
    pack_routes,
    record_routes,
    replay_routes,
    unpack_routes,
)

pytestmark = pytest.mark.integration

VOCAB, LAYERS, EXPERTS, TOP_K = 32, 2, 8, 2
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": TOP_K,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def _model(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    moe = {"num_experts": EXPERTS, "moe_intermediate_size": 32, "norm_topk_prob": True}
    configs = {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, {**moe, "head_dim": 16}),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            {**moe, "shared_expert_intermediate_size": 32},
        ),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, {**moe, "norm_topk_prob": False}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": EXPERTS}),
    }
    config_cls, model_cls, extra = configs[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**SIZES, **extra)).eval()


def _gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers]


class RouterInputs:
    """The test's own hooks: what each router module received, per forward call."""

    def __init__(self, model: torch.nn.Module):
        self.gates = _gates(model)
        self.seen: list[list[torch.Tensor]] = [[] for _ in self.gates]
        self.handles = [
            g.register_forward_pre_hook(self._hook(i)) for i, g in enumerate(self.gates)
        ]

    def _hook(self, layer: int):
        def hook(module, args):
            self.seen[layer].append(args[0].detach().reshape(-1, module.hidden_dim).clone())

        return hook

    def probs(self, layer: int, call: int) -> torch.Tensor:
        x = self.seen[layer][call]
        logits = F.linear(x, self.gates[layer].weight.to(x.dtype))
        return torch.softmax(logits.float(), dim=-1)

    def topk(self, shape: tuple[int, int], call: int = 0) -> torch.Tensor:
        """[B, S, L, K] softmax + top-k of the router logits of one forward call."""
        per_layer = [
            torch.topk(self.probs(layer, call), TOP_K, dim=-1).indices.view(*shape, TOP_K)
            for layer in range(len(self.gates))
        ]
        return torch.stack(per_layer, dim=2)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_recorded_training_routes_equal_softmax_topk_of_router_logits(family):
    model = _model(family)
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    seen = RouterInputs(model)
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    seen.close()
    routes = rec.routes()
    assert routes.shape == (4, 10, LAYERS, TOP_K)
    assert torch.equal(routes, seen.topk((4, 10)))


def test_generation_records_every_position_including_the_last_token():
    """Prefill, each decode step and the final token: ids equal the recomputation per call."""
    model = _model().to(torch.bfloat16)
    prompts = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0  # a left-padded prompt
    prompts[0, :2] = 0
    seen = RouterInputs(model)
    torch.manual_seed(3)
    gen = generate_with_routes(
        model,
        input_ids=prompts,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=True,
    )
    seen.close()
    batch, total = gen.sequences.shape
    assert total == 9 and gen.routes.shape == (batch, total, LAYERS, TOP_K)
    calls = len(seen.seen[0])
    assert calls == 1 + 4  # prefill [B, 5], three decode steps, one step for the last token
    expected = [seen.topk((batch, 5), 0)] + [seen.topk((batch, 1), c) for c in range(1, calls)]
    assert torch.equal(gen.routes, torch.cat(expected, dim=1))
    assert gen.logits.shape == (batch, 4, VOCAB)


def test_packed_routes_hold_the_real_tokens_in_sample_order():
    routes = torch.arange(2 * 3 * LAYERS * TOP_K).view(2, 3, LAYERS, TOP_K) % EXPERTS
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    packed = pack_routes(routes, mask, EXPERTS)
    assert packed.shape == (5, LAYERS, TOP_K) and packed.dtype.name == "uint8"
    assert (packed[:2] == routes[0, 1:].numpy()).all()
    back = unpack_routes(packed, mask)
    assert (back[0, 0] == -1).all() and torch.equal(back[mask.bool()], routes[mask.bool()])


class FooTopKRouter(torch.nn.Module):
    """A router class hf_moe has never seen."""


def test_a_dense_model_is_refused_with_a_clear_error():
    import transformers as tf

    dense = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SIZES, head_dim=16))
    with pytest.raises(UnsupportedMoEModel, match="Qwen3ForCausalLM has no supported MoE router"):
        record_routes(dense)


def test_an_unknown_router_family_is_refused_by_name():
    model = _model()
    model.model.layers[0].mlp.extra_router = FooTopKRouter()
    with pytest.raises(UnsupportedMoEModel, match="FooTopKRouter"):
        replay_routes(model, torch.zeros(1, 1, LAYERS, TOP_K, dtype=torch.long))


class ExpertInputs:
    """The test's own hook on each experts module: the ids and gates it was handed."""

    def __init__(self, model: torch.nn.Module):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layers: list[int] = []  # the MoE layer of each entry of seen
        self.handles = [
            layer.mlp.experts.register_forward_pre_hook(self._hook(i))
            for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, layer: int):
        def hook(module, args):
            self.layers.append(layer)
            self.seen.append((args[1].detach().clone(), args[2].detach().clone()))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _forced_routes(natural: torch.Tensor, seed: int) -> torch.Tensor:
    """Distinct random expert ids per (token, layer): differ from the router's own somewhere."""
    g = torch.Generator().manual_seed(seed)
    rows = natural.shape[:-1].numel()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)])
    return ids.view(natural.shape)


def test_replay_executes_exactly_the_replayed_ids():
    from trajstore.router.metrics import compute_router_metrics

    model = _model()
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), record_routes(model) as own:
        model(input_ids=ids)
    forced = _forced_routes(own.routes(), seed=5)
    assert not torch.equal(forced, own.routes())
    experts, seen = ExpertInputs(model), RouterInputs(model)
    with torch.no_grad(), replay_routes(model, forced) as rec:
        model(input_ids=ids)
    experts.close()
    seen.close()
    executed = torch.stack([i.view(4, 10, TOP_K) for i, _ in experts.seen], dim=2)
    assert torch.equal(executed, forced)
    mask = torch.ones(4, 10, dtype=torch.long)
    metrics = compute_router_metrics(
        pack_routes(forced, mask, EXPERTS),
        pack_routes(rec.routes(), mask, EXPERTS),
        total_lengths=[10] * 4,
        response_lengths=[6] * 4,
        loss_masks=[[1] * 6] * 4,
        num_experts=EXPERTS,
        num_layers=LAYERS,
        top_k=TOP_K,
    )
    assert metrics.route_mismatch_rate == 0.0 and metrics.valid_token_layers == 4 * 6 * LAYERS
    assert torch.equal(rec.natural_routes(), seen.topk((4, 10)))  # what the router chose


def test_replayed_gates_are_the_training_routers_renormalised_softmax():
    model = _model()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    forced = _forced_routes(torch.zeros(2, 7, LAYERS, TOP_K), seed=7)
    seen, experts = RouterInputs(model), ExpertInputs(model)
    with torch.no_grad(), replay_routes(model, forced):
        model(input_ids=ids)
    seen.close()
    experts.close()
    for layer, (_, gates) in enumerate(experts.seen):
        at = seen.probs(layer, 0).gather(-1, forced[:, :, layer].reshape(-1, TOP_K))
        torch.testing.assert_close(gates, at / at.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_the_router_keeps_its_gradient_under_replay():
    model = _model().train()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    forced = _forced_routes(torch.zeros(2, 7, LAYERS, TOP_K), seed=9)
    with replay_routes(model, forced):
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in _gates(model))


def test_padding_rows_of_minus_one_are_left_to_the_router():
    model = _model()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad(), record_routes(model) as own:
        model(input_ids=ids)
    forced = _forced_routes(own.routes(), seed=11)
    forced[0, :3] = -1
    with torch.no_grad(), replay_routes(model, forced) as rec:
        model(input_ids=ids)
    assert torch.equal(rec.routes()[0, :3], own.routes()[0, :3])
    assert torch.equal(rec.routes()[0, 3:], forced[0, 3:])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.full((2, 6, LAYERS, TOP_K), EXPERTS), r"must lie in \[0, 8\)"),
        (torch.zeros(2, 6, LAYERS, TOP_K, dtype=torch.long), "repeats an expert id"),
        (torch.zeros(2, 6, LAYERS + 1, TOP_K, dtype=torch.long), r"must be \[B, S, 2, 2\]"),
    ],
)
def test_malformed_replay_routes_are_refused_before_any_forward(bad, message):
    with pytest.raises(ValueError, match=message):
        replay_routes(_model(), bad)


# ---- baseline vs r3: two short GRPO runs captured into a store, compared by the CLI

STEPS = 2


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    from trajstore.examples.hf_moe_r3 import run_into_store

    store = tmp_path_factory.mktemp("hf_moe") / "store"
    records = run_into_store(store, steps=STEPS, seed=0)
    return store, records


def _trajstore(*args: str) -> subprocess.CompletedProcess:
    """`trajstore *args` run in this process (`trajstore.cli.main`), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def compared(hf_runs):
    store, _ = hf_runs
    proc = _trajstore(
        "router", "compare", "--store", str(store), "--run", "hf-baseline", "--run", "hf-r3",
        "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_router_compare_shows_baseline_route_mismatch_above_zero(compared):
    rows = [step["runs"]["hf-baseline"] for step in compared["steps"]]
    assert len(rows) == STEPS and all(r["metric_error"] == [] for r in rows)
    assert sum(r["route_mismatch_rate"] for r in rows) > 0.0


def test_router_compare_prints_no_stability_counter_nobody_measured(compared):
    """Generation runs in-process: no engine could hang or fail, so none is counted (null)."""
    for run in ("hf-baseline", "hf-r3"):
        stability = compared["stability"][run]
        assert (stability["hang_count"], stability["engine_error_count"]) == (None, None)


def test_router_compare_shows_r3_route_mismatch_exactly_zero(compared):
    rows = [step["runs"]["hf-r3"] for step in compared["steps"]]
    assert len(rows) == STEPS
    assert all(r["route_mismatch_rate"] == 0.0 and r["metric_error"] == [] for r in rows)
    assert all(r["valid_token_layers"] == 16 * 8 * LAYERS for r in rows)


def test_r3_overrode_the_training_router_where_it_drifted(hf_runs):
    """r3's zero is replay at work: its own router disagreed with the rollout somewhere."""
    _, records = hf_runs
    assert any((r.natural_routes != r.rollout_routes).any() for r in records["r3"])


@pytest.mark.parametrize("run", ["hf-baseline", "hf-r3"])
def test_captured_hf_moe_steps_replay_with_exit_0(hf_runs, run):
    store, _ = hf_runs
    proc = _trajstore("replay", "--store", str(store), "--run", run, "--all", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["total"] == 2 * STEPS and summary["refused"] == 0


def test_replay_holds_through_activation_checkpointing_recompute():
    """Backward recomputes each layer: the recomputed routers execute the replayed ids too."""
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(12))
    forced = _forced_routes(torch.zeros(2, 7, LAYERS, TOP_K), seed=13)
    grads = []
    for checkpointing in (False, True):
        model = _model().train()
        if checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable({"use_reentrant": False})
        experts = ExpertInputs(model)
        with replay_routes(model, forced) as rec:
            model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        experts.close()
        assert rec.calls == [(2, 7)]
        assert all(
            torch.equal(i.view(2, 7, TOP_K), forced[:, :, layer])
            for layer, (i, _) in zip(experts.layers, experts.seen, strict=True)
        )
        grads.append(torch.cat([g.weight.grad.flatten() for g in _gates(model)]))
    assert len(experts.seen) == 2 * LAYERS  # forward and recompute of each layer
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_the_example_refuses_an_unusable_store_in_one_line(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "trajstore.examples.hf_moe_r3", "--store", str(not_a_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"hf_moe_r3: error: {not_a_dir}: exists and is not a directory"
    ]


def test_rollout_routes_with_eos_padding_replay_exactly_in_a_training_forward():
    """Rows that stop at EOS: padding masked out, the real tokens replay with 0 mismatch."""
    engine = _model().to(torch.bfloat16)
    policy = _model()  # same seed: the float32 weights the bf16 engine was cast from
    prompts = torch.randint(3, VOCAB, (6, 4), generator=torch.Generator().manual_seed(14))
    torch.manual_seed(15)
    gen = generate_with_routes(
        engine,
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=8,
        do_sample=True,
        eos_token_id=list(range(1, 9)),  # a quarter of the vocabulary ends a row
    )
    lengths = gen.attention_mask.sum(1)
    assert lengths.min() < gen.sequences.shape[1]  # some row stopped early and was padded
    for row, n in zip(gen.sequences, lengths.tolist(), strict=True):
        response = row[4:n].tolist()
        ends = [i for i, tok in enumerate(response) if 1 <= tok <= 8]
        # the mask ends at the row's first EOS; a full-length row may hold none
        assert ends == [len(response) - 1] or (n == row.shape[0] and ends == [])
    rollout = pack_routes(gen.routes, gen.attention_mask, EXPERTS)
    assert rollout.shape[0] == int(lengths.sum())
    replay = unpack_routes(rollout, gen.attention_mask)
    with torch.no_grad(), replay_routes(policy, replay) as rec:
        policy(input_ids=gen.sequences, attention_mask=gen.attention_mask)
    assert (pack_routes(rec.routes(), gen.attention_mask, EXPERTS) == rollout).all()


def test_beam_search_generation_is_refused():
    """Beams are reordered between decode steps: one route per row and token cannot hold."""
    prompts = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(16))
    with pytest.raises(ValueError, match="beam search"):
        generate_with_routes(
            _model(), input_ids=prompts, attention_mask=torch.ones_like(prompts), num_beams=2
        )


def test_several_return_sequences_each_get_their_prompts_routes():
    model = _model().to(torch.bfloat16)
    prompts = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(17))
    mask = torch.ones_like(prompts)
    mask[1, 0] = 0
    torch.manual_seed(18)
    gen = generate_with_routes(
        model,
        input_ids=prompts,
        attention_mask=mask,
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=True,
        num_return_sequences=3,
    )
    assert gen.sequences.shape == (6, 7) and gen.routes.shape == (6, 7, LAYERS, TOP_K)
    assert gen.attention_mask[:, 0].tolist() == [1, 1, 1, 0, 0, 0]
    assert torch.equal(gen.routes[0, :4], gen.routes[2, :4])  # the same prompt, the same routes


# ---- the same through TRL's GRPOTrainer (trajstore.integrations.trl), bf16 rollout_func

TRL_STEPS = 2


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    from trajstore.examples.trl_moe_r3 import run_into_store

    store = tmp_path_factory.mktemp("trl_moe") / "store"
    trainers = run_into_store(store, steps=TRL_STEPS, seed=0)
    return store, trainers


@pytest.fixture(scope="module")
def trl_compared(trl_runs):
    store, _ = trl_runs
    proc = _trajstore(
        "router", "compare", "--store", str(store), "--run", "trl-baseline", "--run", "trl-r3",
        "--format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_trl_router_compare_shows_baseline_route_mismatch_above_zero(trl_compared):
    rows = [step["runs"]["trl-baseline"] for step in trl_compared["steps"]]
    assert len(rows) == TRL_STEPS and all(r["metric_error"] == [] for r in rows)
    assert sum(r["route_mismatch_rate"] for r in rows) > 0.0


def test_trl_router_compare_shows_r3_route_mismatch_exactly_zero(trl_compared):
    """TRL trains with activation checkpointing on: the recomputed layers replay too."""
    rows = [step["runs"]["trl-r3"] for step in trl_compared["steps"]]
    assert len(rows) == TRL_STEPS and all(r["valid_token_layers"] > 0 for r in rows)
    assert all(r["route_mismatch_rate"] == 0.0 and r["metric_error"] == [] for r in rows)


@pytest.mark.parametrize("run", ["trl-baseline", "trl-r3"])
def test_trl_captured_bundles_replay_with_exit_0(trl_runs, run):
    store, _ = trl_runs
    proc = _trajstore("replay", "--store", str(store), "--run", run, "--all", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["total"] == 2 * TRL_STEPS and summary["refused"] == 0
