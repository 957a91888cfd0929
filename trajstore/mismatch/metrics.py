"""Names of the stored sums and derived per-step metrics, and the SQL between them.

No NumPy, no SQLAlchemy: `trajstore query mismatch` imports only this and DuckDB's
driver. A step's value of a metric is computed from the *sums* of its bundles (ranks)
in one GROUP BY, so ranks add up by numerators and denominators, never by averaging
rates (docs/mismatch.md). A metric that cannot be measured on a step is NULL with a
reason (`reason` column), never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: (pair name, trainer-side payload): each is compared with ``rollout_log_probs``
PAIRS: tuple[tuple[str, str], ...] = (
    ("old", "old_log_probs"),
    ("current", "log_probs"),
    ("train", "train_log_probs"),
)
ROLLOUT_PAYLOAD = "rollout_log_probs"
#: |Δ log p| thresholds whose exceedance fraction is kept: (name suffix, value)
THRESHOLDS: tuple[tuple[str, float], ...] = (
    ("0_1", 0.1),
    ("0_5", 0.5),
    ("ln2", math.log(2.0)),
    ("1", 1.0),
)
#: config keys read, in order, for the truncation cap C of the importance ratio
CLIP_CONFIG_KEYS: tuple[str, ...] = ("is_clip_max", "tis_imp_ratio_cap", "rollout_is_threshold")

#: per-pair sum columns (catalog column ``<pair>_<field>``): (field, SQL type)
PAIR_FIELDS: tuple[tuple[str, str], ...] = (
    ("n", "BIGINT"),
    ("abs_dlogp_sum", "DOUBLE"),
    ("abs_dlogp_max", "DOUBLE"),
    ("abs_dp_sum", "DOUBLE"),
    ("abs_dp_max", "DOUBLE"),
    ("d_sum", "DOUBLE"),
    ("k3_sum", "DOUBLE"),
    ("mult_sum", "DOUBLE"),
    ("pr_sum", "DOUBLE"),
    ("pt_sum", "DOUBLE"),
    ("pr2_sum", "DOUBLE"),
    ("pt2_sum", "DOUBLE"),
    ("prpt_sum", "DOUBLE"),
    *((f"gt_{name}", "BIGINT") for name, _ in THRESHOLDS),
    ("ratio_min", "DOUBLE"),
    ("ratio_max", "DOUBLE"),
    ("clip_c", "DOUBLE"),
    ("clip_count", "BIGINT"),
    ("error", "TEXT"),
)
#: route sum columns: (column, SQL type); router-metrics.md's numerators and denominators
ROUTE_FIELDS: tuple[tuple[str, str], ...] = (
    ("route_valid_tokens", "BIGINT"),
    ("route_valid_token_layers", "BIGINT"),
    ("route_mismatches", "BIGINT"),
    ("route_missing_slots", "BIGINT"),
    ("route_mismatched_tokens", "BIGINT"),
    ("route_top_k", "BIGINT"),
    ("route_error", "TEXT"),
)


def sum_columns() -> list[tuple[str, str]]:
    """Every sum column of ``mismatch_metrics`` after the identity ones: (name, SQL type)."""
    cols = [(f"{pair}_{field}", kind) for pair, _ in PAIRS for field, kind in PAIR_FIELDS]
    return cols + list(ROUTE_FIELDS)


# --------------------------------------------------------------------------- derived metrics

_F = "CAST({} AS DOUBLE PRECISION)"


def _div(num: str, den: str) -> str:
    return f"({_F.format(num)} / nullif({den}, 0))"


@dataclass(frozen=True)
class Metric:
    """One per-step metric: its SQL value over a step's rows (aliased ``m``), the
    token count it was computed on, and the SQL reason it is NULL (else NULL)."""

    name: str
    value: str
    tokens: str
    reason: str
    family: str  # "route" or a pair name
    doc: str


def _pair_metrics(pair: str, payload: str) -> list[Metric]:
    def c(field: str) -> str:
        return f"m.{pair}_{field}"

    n = f"sum({c('n')})"
    # any rank's error nulls the step (a failing rank is never averaged away)
    base_reason = (
        f"CASE WHEN count({c('error')}) > 0 THEN min({c('error')}) "
        f"WHEN coalesce({n}, 0) = 0 THEN 'empty_response_mask: no masked-in response token' "
        "END"
    )

    def metric(name: str, value: str, doc: str, reason: str = base_reason) -> Metric:
        guarded = f"CASE WHEN ({reason}) IS NULL THEN {value} END"
        return Metric(f"{pair}_{name}", guarded, n, reason, pair, doc)

    pearson_num = f"({n} * sum({c('prpt_sum')}) - sum({c('pr_sum')}) * sum({c('pt_sum')}))"
    var_r = f"({n} * sum({c('pr2_sum')}) - sum({c('pr_sum')}) * sum({c('pr_sum')}))"
    var_t = f"({n} * sum({c('pt2_sum')}) - sum({c('pt_sum')}) * sum({c('pt_sum')}))"
    pearson_reason = (
        f"coalesce({base_reason}, CASE WHEN NOT ({var_r} > 0 AND {var_t} > 0) THEN "
        "'constant_probabilities: the probabilities of one side do not vary' END)"
    )
    clip_reason = (
        f"coalesce({base_reason}, CASE WHEN count({c('clip_c')}) < count(*) THEN "
        "'no_clip_cap: the bundle config names no truncation cap (is_clip_max)' END)"
    )
    d_mean = _div(f"sum({c('d_sum')})", n)
    out = [
        metric("tokens", f"{n}", f"masked-in response tokens with both {payload} and rollout"),
        metric("abs_dlogp_mean", _div(f"sum({c('abs_dlogp_sum')})", n), "mean |Δ log p|"),
        metric("abs_dlogp_max", f"max({c('abs_dlogp_max')})", "max |Δ log p|"),
        metric("abs_dp_mean", _div(f"sum({c('abs_dp_sum')})", n), "mean |Δ p|"),
        metric("abs_dp_max", f"max({c('abs_dp_max')})", "max |Δ p|"),
        metric("kl_k1", f"(-{d_mean})", "mean(-d), d = trainer - rollout"),
        metric("kl_k3", _div(f"sum({c('k3_sum')})", n), "mean(exp(d) - 1 - d)"),
        metric(
            "ppl_ratio",
            f"exp(-{d_mean})",
            "trainer perplexity / rollout perplexity",
        ),
        metric("mult_prob_error", _div(f"sum({c('mult_sum')})", n), "mean exp(|d|)"),
        metric(
            "prob_pearson",
            f"({_F.format(pearson_num)} / nullif(sqrt({_F.format(var_r)}) * "
            f"sqrt({_F.format(var_t)}), 0))",
            "Pearson correlation of the two sides' probabilities",
            pearson_reason,
        ),
        *(
            metric(
                f"frac_dlogp_gt_{tname}",
                _div(f"sum({c('gt_' + tname)})", n),
                f"fraction of tokens with |Δ log p| > {tvalue:.6g}",
            )
            for tname, tvalue in THRESHOLDS
        ),
        metric("is_ratio_min", f"min({c('ratio_min')})", "min exp(d)"),
        metric("is_ratio_max", f"max({c('ratio_max')})", "max exp(d)"),
        metric(
            "is_clip_frac",
            _div(f"sum({c('clip_count')})", n),
            "fraction of tokens with exp(d) > C (the config's cap)",
            clip_reason,
        ),
    ]
    return out


def _route_metrics() -> list[Metric]:
    vt, vtl = "sum(m.route_valid_tokens)", "sum(m.route_valid_token_layers)"
    reason = (
        "CASE WHEN count(m.route_error) > 0 THEN min(m.route_error) "
        f"WHEN coalesce({vt}, 0) = 0 THEN 'empty_response_mask: no masked-in response token' "
        f"WHEN coalesce({vtl}, 0) = 0 THEN 'empty_response_mask: every compared layer is dense' "
        "END"
    )

    def metric(name: str, value: str, tokens: str, doc: str) -> Metric:
        return Metric(
            name, f"CASE WHEN ({reason}) IS NULL THEN {value} END", tokens, reason, "route", doc
        )

    slot = _div("sum(m.route_missing_slots)", f"(max(m.route_top_k) * {vtl})")
    return [
        metric(
            "route_mismatch_rate",
            _div("sum(m.route_mismatches)", vtl),
            vtl,
            "fraction of valid (token, layer) whose expert sets differ",
        ),
        metric("expert_slot_mismatch", slot, vtl, "mean 1 - |A ∩ B| / K"),
        metric("topk_overlap", f"(1 - {slot})", vtl, "mean |A ∩ B| / K"),
        metric(
            "token_any_mismatch",
            _div("sum(m.route_mismatched_tokens)", vt),
            vt,
            "fraction of valid tokens with any layer differing",
        ),
        metric("route_tokens", vt, vt, "valid tokens whose routes were compared"),
    ]


def _aliases(by_name: dict[str, Metric]) -> list[Metric]:
    """router-metrics.md's log-prob names: the rollout vs train_log_probs pair."""
    names = {
        "kl_k1": "train_kl_k1",
        "kl_k3": "train_kl_k3",
        "f_tau_2": "train_frac_dlogp_gt_ln2",
        "logprob_abs_diff": "train_abs_dlogp_mean",
    }
    out = []
    for alias, target in names.items():
        m = by_name[target]
        out.append(Metric(alias, m.value, m.tokens, m.reason, m.family, f"= {target}"))
    return out


def _all_metrics() -> dict[str, Metric]:
    metrics = _route_metrics()
    for pair, payload in PAIRS:
        metrics += _pair_metrics(pair, payload)
    by_name = {m.name: m for m in metrics}
    for m in _aliases(by_name):
        by_name[m.name] = m
    return by_name


METRICS: dict[str, Metric] = _all_metrics()
DEFAULT_METRIC = "route_mismatch_rate"
#: metrics a step listing shows beside the selected one (``--json`` shows every metric)
SUMMARY_METRICS: tuple[str, ...] = (
    "route_mismatch_rate",
    "token_any_mismatch",
    "old_kl_k3",
    "old_abs_dlogp_max",
    "train_kl_k3",
)
