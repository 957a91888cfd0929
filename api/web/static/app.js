"use strict";
// The trajstore web view: one shell page, a client-side router over location.pathname,
// and every piece of data fetched from /v1 (docs/web.md). The API token, when the
// server has one, is asked for once per tab, kept in sessionStorage and sent as the
// Authorization header; it is never put in a URL. Text from the store is always set
// with textContent (never innerHTML), so names and values cannot inject markup.

const TOKEN_KEY = "trajstore.token";
const STATUSES = ["pass", "diverged", "refused", "unsupported", "unreplayed"];
const ROUTE_METRICS = [
  ["route_mismatch_rate", "route mismatch rate"],
  ["f_tau_2", "f_tau_2"],
  ["kl_k3", "kl_k3"],
  ["logprob_abs_diff", "log-prob drift (mean |diff|)"],
];
const SORTS = [
  ["step", "rollout, step"],
  ["-step", "rollout, step (newest first)"],
  ["status", "status"],
  ["-status", "status (reversed)"],
  ["stage", "first divergent stage"],
  ["-stage", "first divergent stage (reversed)"],
  ["-tokens", "tokens (most first)"],
  ["tokens", "tokens (fewest first)"],
];

// -- DOM helpers -------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const fmt = (value) => Charts.fmt(value);

function bytes(n) {
  if (n === null || n === undefined) return "null";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let value = n;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return i === 0 ? `${n} B` : `${value.toFixed(1)} ${units[i]}`;
}

function badge(status) {
  const word = status || "unreplayed";
  return h("span", { class: `badge ${word}`, "data-status": word }, word);
}

function table(headers, rows, attrs) {
  return h(
    "table",
    attrs || {},
    h("thead", {}, h("tr", {}, headers.map((name) => h("th", {}, name)))),
    h("tbody", {}, rows),
  );
}

function enc(part) {
  return encodeURIComponent(part);
}

// Replace a node's children; arrays are flattened and null/false children dropped.
function fill(node, ...children) {
  node.replaceChildren(
    ...children
      .flat(Infinity)
      .filter((child) => child !== undefined && child !== null && child !== false)
      .map((child) => (child instanceof Node ? child : document.createTextNode(String(child)))),
  );
  return node;
}

function render(...nodes) {
  return fill(document.getElementById("main"), ...nodes);
}

function showError(where, error) {
  const detail = error.body ? JSON.stringify(error.body.detail) : String(error);
  const code = error.body ? error.body.error : "error";
  fill(where, h("p", { class: "error", "data-error": code }, `${code}: ${detail}`));
}

// -- API: bearer token asked once, never in a URL ---------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    super(`${status} ${body ? body.error : ""}`);
    this.status = status;
    this.body = body;
  }
}

let tokenPrompt = null;

function askToken(refused) {
  if (tokenPrompt) return tokenPrompt;
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  document.getElementById("token-error").hidden = !refused;
  tokenPrompt = new Promise((resolve) => {
    const form = document.getElementById("token-form");
    const done = (event) => {
      event.preventDefault();
      if (!input.value) return;
      sessionStorage.setItem(TOKEN_KEY, input.value);
      input.value = "";
      form.removeEventListener("submit", done);
      dialog.close();
      tokenPrompt = null;
      document.getElementById("forget-token").hidden = false;
      resolve();
    };
    form.addEventListener("submit", done);
  });
  dialog.showModal();
  input.focus();
  return tokenPrompt;
}

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function request(path, options) {
  const init = Object.assign({}, options || {});
  init.headers = Object.assign({}, init.headers || {}, authHeaders());
  const response = await fetch(path, init);
  if (response.status === 401) {
    const hadToken = Boolean(sessionStorage.getItem(TOKEN_KEY));
    sessionStorage.removeItem(TOKEN_KEY);
    await askToken(hadToken);
    return request(path, options);
  }
  return response;
}

async function api(path, options) {
  const response = await request(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
}

// A payload link: a plain href (no token in it); with a token the click downloads
// through fetch with the header instead, since a navigation cannot carry it.
function downloadLink(url, label, filename) {
  const link = h("a", { href: url, download: filename, class: "download" }, label);
  link.addEventListener("click", async (event) => {
    if (!sessionStorage.getItem(TOKEN_KEY)) return;
    event.preventDefault();
    const response = await request(url);
    if (!response.ok) return;
    const blob = URL.createObjectURL(await response.blob());
    const save = h("a", { href: blob, download: filename });
    document.body.appendChild(save);
    save.click();
    save.remove();
    setTimeout(() => URL.revokeObjectURL(blob), 10000);
  });
  return link;
}

// -- Runs --------------------------------------------------------------------------

function histogram(hist) {
  const entries = Object.entries(hist);
  if (!entries.length) return h("span", { class: "muted" }, "-");
  const top = Math.max(...entries.map(([, n]) => n));
  return h(
    "div",
    { class: "hist" },
    entries.map(([stage, n]) =>
      h(
        "div",
        { "data-stage": stage, "data-count": n },
        h("div", { class: "bar", style: `width:${Math.max((n / top) * 10, 0.3)}em` }),
        h("span", {}, `${stage} ${n}`),
      ),
    ),
  );
}

async function runsPage() {
  document.title = "trajstore: runs";
  const runs = (await api("/v1/runs")).items;
  const rows = runs.map((run) =>
    h(
      "tr",
      { "data-run": run.run },
      h("td", {}, h("a", { href: `/runs/${enc(run.run)}` }, run.run)),
      h("td", { class: "num" }, run.num_step_bundles),
      h("td", { class: "num" }, run.num_rollout_bundles),
      h("td", { class: "num" }, `${fmt(run.min_rollout_id)}-${fmt(run.max_rollout_id)}`),
      h("td", { class: "num summary", colspan: 9 }, h("span", { class: "muted" }, "loading")),
    ),
  );
  const picker = h(
    "form",
    { action: "/routes", method: "get", id: "routes-form", class: "filters" },
    runs.map((run) =>
      h("label", {}, h("input", { type: "checkbox", name: "run", value: run.run }), run.run),
    ),
    h("button", { type: "submit" }, "compare routes"),
  );
  render(
    h("h1", {}, "Runs"),
    table(
      [
        "run",
        "step bundles",
        "rollout bundles",
        "rollouts",
        "steps",
        ...STATUSES,
        "first divergent stage",
        "logical",
        "stored",
        "dedup",
      ],
      rows,
      { id: "runs" },
    ),
    h("p", { class: "muted" }, "Counts are actor steps (latest attempt) by their latest recorded verdict; stored bytes are what the run's bundles added to the store when ingested (not recorded for bundles ingested before trajstore recorded it)."),
    h("h2", {}, "Route consistency"),
    picker,
  );
  await Promise.all(
    runs.map(async (run, i) => {
      const cell = rows[i].querySelector(".summary");
      try {
        const s = await api(`/v1/runs/${enc(run.run)}/summary`);
        const cells = [
          h("td", { class: "num", "data-field": "steps" }, s.steps),
          ...STATUSES.map((status) =>
            h("td", { class: "num", "data-field": status }, s.by_status[status] || 0),
          ),
          h("td", {}, histogram(s.first_divergent_stage_histogram)),
          h("td", { class: "num" }, bytes(s.logical_bytes)),
          h("td", { class: "num", "data-field": "stored", "data-bytes": s.physical_bytes ?? "" }, s.physical_bytes === null ? "not recorded" : bytes(s.physical_bytes)),
          h("td", { class: "num", "data-field": "dedup" }, s.physical_bytes === null ? "not recorded" : s.dedup_ratio === null ? "null" : `${s.dedup_ratio}x`),
        ];
        cell.replaceWith(...cells);
      } catch (error) {
        showError(cell, error);
      }
    }),
  );
}

// -- Steps of a run ------------------------------------------------------------------

const STEP_FILTERS = ["status", "first_divergent_stage", "rollout_from", "rollout_to", "attempt", "sort", "limit"];

function stepFilters(params, summary) {
  const value = (name) => params.get(name) || "";
  const stages = Object.keys(summary.first_divergent_stage_histogram);
  const current = value("first_divergent_stage");
  if (current && !stages.includes(current)) stages.push(current);
  return h(
    "form",
    { class: "filters", id: "step-filters", method: "get" },
    h(
      "label",
      {},
      "status",
      h("select", { name: "status" }, h("option", { value: "" }, "any"), STATUSES.map((s) =>
        h("option", { value: s, selected: value("status") === s }, s),
      )),
    ),
    h(
      "label",
      {},
      "first divergent stage",
      h("select", { name: "first_divergent_stage" }, h("option", { value: "" }, "any"), stages.map((s) =>
        h("option", { value: s, selected: current === s }, s),
      )),
    ),
    h("label", {}, "rollout from", h("input", { type: "number", min: 0, name: "rollout_from", value: value("rollout_from") })),
    h("label", {}, "rollout to", h("input", { type: "number", min: 0, name: "rollout_to", value: value("rollout_to") })),
    h("label", {}, "latest attempt", h("input", { type: "number", min: 1, name: "attempt", value: value("attempt") })),
    h(
      "label",
      {},
      "sort",
      h("select", { name: "sort" }, SORTS.map(([key, label]) =>
        h("option", { value: key, selected: (value("sort") || "step") === key }, label),
      )),
    ),
    h(
      "label",
      {},
      "per page",
      h("select", { name: "limit" }, ["25", "50", "100", "250"].map((n) =>
        h("option", { value: n, selected: (value("limit") || "50") === n }, n),
      )),
    ),
    h("button", { type: "submit", id: "apply-filters" }, "apply"),
    h("a", { href: location.pathname }, "clear"),
  );
}

function stepRow(run, step) {
  const ref = `${step.rollout_id}:${step.step_id}`;
  return h(
    "tr",
    { "data-step": ref, "data-status": step.status || "unreplayed", "data-stage": step.first_divergent_stage || "" },
    h("td", {}, h("a", { href: `/runs/${enc(run)}/steps/${ref}` }, ref)),
    h("td", { class: "num" }, step.attempt),
    h("td", {}, step.ranks.length ? step.ranks.join(",") : "-"),
    h("td", { class: "num" }, fmt(step.num_samples)),
    h("td", { class: "num" }, fmt(step.num_tokens)),
    h("td", {}, badge(step.status)),
    h("td", {}, step.first_divergent_stage || ""),
    h("td", { class: "muted" }, step.recorded_at || ""),
  );
}

async function stepsPage(run) {
  document.title = `trajstore: ${run}`;
  const params = new URLSearchParams(location.search);
  const summary = await api(`/v1/runs/${enc(run)}/summary`);
  const stripBox = h("div", { id: "strip" }, h("span", { class: "muted" }, "loading strip"));
  const tbody = h("tbody", {});
  const pageInfo = h("span", { class: "muted", id: "page-info" });
  const prev = h("button", { type: "button", id: "prev-page", disabled: true }, "previous");
  const next = h("button", { type: "button", id: "next-page", disabled: true }, "next");
  render(
    h("p", {}, h("a", { href: "/" }, "runs"), " / ", run),
    h("h1", {}, `Run ${run}`),
    h("p", {}, h("a", { href: `/runs/${enc(run)}/mismatch`, id: "mismatch-link" }, "training-inference mismatch over steps")),
    h(
      "p",
      { id: "run-summary" },
      `${summary.steps} steps: `,
      STATUSES.map((s) => h("span", {}, badge(s), ` ${summary.by_status[s] || 0}  `)),
    ),
    h("h2", {}, "Verdict by rollout id"),
    stripBox,
    h(
      "p",
      { class: "legend muted" },
      STATUSES.map((s) => h("span", {}, h("i", { style: `background:${Charts.COLORS[s]}` }), s)),
      " each bar is the worst verdict of its rollouts; click one to show its steps",
    ),
    h("h2", {}, "Steps"),
    stepFilters(params, summary),
    h(
      "table",
      { id: "steps" },
      h("thead", {}, h("tr", {}, ["step", "attempt", "ranks", "samples", "tokens", "status", "first divergent stage", "recorded"].map((n) => h("th", {}, n)))),
      tbody,
    ),
    h("div", { class: "pager" }, prev, pageInfo, next),
  );

  const query = new URLSearchParams();
  for (const name of STEP_FILTERS) if (params.get(name)) query.set(name, params.get(name));
  if (!query.get("limit")) query.set("limit", "50");

  const stripQuery = new URLSearchParams();
  for (const name of ["rollout_from", "rollout_to"]) if (params.get(name)) stripQuery.set(name, params.get(name));
  const width = Math.min(Math.max(document.getElementById("main").clientWidth - 40, 300), 1200);
  stripQuery.set("bins", String(Math.min(Math.floor(width / 3), 2000)));
  api(`/v1/runs/${enc(run)}/strip?${stripQuery}`)
    .then((strip) => {
      const pick = (bin) => {
        const target = new URLSearchParams(location.search);
        target.set("rollout_from", bin.rollout_from);
        target.set("rollout_to", bin.rollout_to);
        location.search = target.toString();
      };
      fill(stripBox, Charts.strip(strip, { width, onPick: pick }));
    })
    .catch((error) => showError(stripBox, error));

  const cursors = [null];
  let page = 0;
  const load = async () => {
    const q = new URLSearchParams(query);
    if (cursors[page]) q.set("cursor", cursors[page]);
    fill(tbody, h("tr", {}, h("td", { colspan: 8, class: "muted" }, "loading")));
    try {
      const result = await api(`/v1/runs/${enc(run)}/steps?${q}`);
      fill(tbody, ...result.items.map((step) => stepRow(run, step)));
      if (!result.items.length) fill(tbody, h("tr", {}, h("td", { colspan: 8, class: "muted" }, "no steps match")));
      cursors[page + 1] = result.next_cursor;
      prev.disabled = page === 0;
      next.disabled = !result.next_cursor;
      pageInfo.textContent = `page ${page + 1}, ${result.items.length} step(s)`;
      document.getElementById("steps").setAttribute("data-loaded", String(page + 1));
    } catch (error) {
      showError(tbody, error);
    }
  };
  prev.addEventListener("click", () => {
    page -= 1;
    load();
  });
  next.addEventListener("click", () => {
    page += 1;
    load();
  });
  await load();
}

// -- One step ------------------------------------------------------------------------

function stagesTable(stages) {
  return table(
    ["stage", "status", "reason", "max abs error", "mismatches", "first sample", "first field", "first token"],
    stages.map((s) =>
      h(
        "tr",
        { "data-stage": s.stage, "data-status": s.status },
        h("td", {}, s.stage),
        h("td", {}, badge(s.status)),
        h("td", {}, s.reason || ""),
        h("td", { class: "num" }, fmt(s.max_abs_error)),
        h("td", { class: "num" }, fmt(s.mismatch_count)),
        h("td", {}, s.first_sample || ""),
        h("td", {}, s.first_field || ""),
        h("td", { class: "num" }, s.first_token === null || s.first_token === undefined ? "" : s.first_token),
      ),
    ),
    { class: "stages" },
  );
}

function divergenceTable(rows, attrs) {
  return table(
    ["stage", "sample", "field", "token offset", "expected", "actual", "error"],
    rows.map((d) =>
      h(
        "tr",
        {
          "data-stage": d.stage,
          "data-sample": d.sample_id || "",
          "data-token": d.token_offset === null || d.token_offset === undefined ? "" : d.token_offset,
        },
        h("td", {}, d.stage),
        h("td", {}, d.sample_id || ""),
        h("td", {}, d.field || ""),
        h("td", { class: "num" }, d.token_offset === null || d.token_offset === undefined ? "" : d.token_offset),
        h("td", { class: "num" }, fmt(d.expected)),
        h("td", { class: "num" }, fmt(d.actual)),
        h("td", { class: "num" }, fmt(d.abs_err === undefined ? d.max_abs_error : d.abs_err)),
      ),
    ),
    attrs,
  );
}

function replayReport(response) {
  const report = response.report;
  const first = report.first_divergence;
  const box = h(
    "div",
    {
      class: "report",
      id: "replay-report",
      "data-status": report.status,
      "data-exit-code": response.exit_code,
      "data-first-divergent-stage": report.first_divergent_stage || "",
      "data-groups": ((report.selection || {}).groups || []).join(","),
    },
    h("p", {}, "verdict ", badge(report.status), ` exit code ${response.exit_code}`,
      report.first_divergent_stage ? `, first divergent stage ${report.first_divergent_stage}` : ""),
  );
  if (first) {
    box.appendChild(
      h("p", { class: "first-diff" },
        `first divergence: ${first.stage} in ${first.bundle_key || "?"}: sample ${first.sample_id || "-"}, field ${first.field || "-"}, token ${first.token_offset === null ? "-" : first.token_offset}, max abs error ${fmt(first.max_abs_error)}`),
    );
  }
  if (report.linkage) box.appendChild(h("p", {}, `rollout linkage: ${report.linkage.status}: ${report.linkage.reason || ""}`));
  for (const bundle of report.bundles || []) {
    box.appendChild(h("h3", {}, `${bundle.label} (${bundle.bundle_key || ""})`));
    box.appendChild(stagesTable(bundle.stages.map((s) => Object.assign({}, s, s.divergences && s.divergences[0] ? {
      first_sample: s.divergences[0].sample_id, first_field: s.divergences[0].field, first_token: s.divergences[0].token_offset,
    } : {}))));
    const divergences = bundle.stages.flatMap((s) => (s.divergences || []).map((d) => Object.assign({ stage: s.stage }, d)));
    if (divergences.length) box.appendChild(divergenceTable(divergences.slice(0, 200), { class: "replay-divergences" }));
  }
  return box;
}

async function stepPage(run, ref) {
  document.title = `trajstore: ${run} ${ref}`;
  const params = new URLSearchParams(location.search);
  const attempt = params.get("attempt");
  const suffix = attempt ? `?attempt=${enc(attempt)}` : "";
  const detail = await api(`/v1/runs/${enc(run)}/steps/${enc(ref)}${suffix}`);
  const verdictBox = h("div", { id: "verdict" }, h("span", { class: "muted" }, "loading"));
  const mismatchBox = h("div", { id: "mismatch" }, h("span", { class: "muted" }, "loading"));
  const rolloutBox = h("div", { id: "rollout" });
  const groupSelect = h(
    "select",
    { id: "replay-group" },
    h("option", { value: "" }, "the whole step"),
    detail.samples.groups.map((g) => {
      const name = g.semantic_group || (g.group_index === null ? null : String(g.group_index));
      return name === null ? null : h("option", { value: name }, `group ${name} (${g.num_samples} samples)`);
    }),
  );
  const replayBox = h("div", { id: "replay-output" });
  const replayButton = h("button", { type: "button", id: "replay-button" }, "replay");
  replayButton.addEventListener("click", async () => {
    replayButton.disabled = true;
    fill(replayBox, h("span", { class: "muted" }, "replaying"));
    const body = { run, step: ref };
    if (attempt) body.attempt = Number(attempt);
    if (groupSelect.value) body.groups = [groupSelect.value];
    try {
      fill(replayBox, replayReport(await post("/v1/replay", body)));
    } catch (error) {
      showError(replayBox, error);
    } finally {
      replayButton.disabled = false;
    }
  });
  const attempts = detail.attempts.map((n) =>
    n === detail.attempt ? h("strong", {}, ` ${n} `) : h("a", { href: `?attempt=${n}` }, ` ${n} `),
  );
  const diffs = [];
  if (detail.attempts.length > 1) {
    const [a, b] = [detail.attempts[0], detail.attempts[detail.attempts.length - 1]];
    diffs.push(h("a", { href: `/diff?a=${enc(`${run}/${ref}@${a}`)}&b=${enc(`${run}/${ref}@${b}`)}`, id: "diff-attempts" }, `diff attempt ${a} with ${b}`));
  }
  render(
    h("p", {}, h("a", { href: "/" }, "runs"), " / ", h("a", { href: `/runs/${enc(run)}` }, run), " / ", ref),
    h("h1", {}, `Step ${ref} of ${run}`),
    h(
      "dl",
      { class: "ident", id: "identity" },
      h("dt", {}, "run"), h("dd", {}, run),
      h("dt", {}, "actor step"), h("dd", { "data-field": "step" }, `rollout ${detail.rollout_id}, step ${detail.step_id}`),
      h("dt", {}, "attempt"), h("dd", {}, attempts, diffs),
      h("dt", {}, "ranks"), h("dd", {}, detail.ranks.length ? detail.ranks.join(", ") : "single producer"),
      h("dt", {}, "samples"), h("dd", {}, `${detail.samples.num_samples} (${detail.samples.num_tokens} tokens, ${detail.samples.num_response_tokens} response tokens)`),
      h("dt", {}, "bundles"), h("dd", { class: "mono" }, detail.bundles.map((b) => h("div", {}, b.key))),
      h("dt", {}, "weights"), h("dd", {}, detail.bundles[0] ? `rollout ${detail.bundles[0].rollout_weight}, actor ${detail.bundles[0].actor_weight}` : ""),
    ),
    h("h2", {}, "Latest recorded verdict"),
    verdictBox,
    h("h2", {}, "Training-inference mismatch"),
    mismatchBox,
    h("h2", {}, "Linked rollout bundle"),
    rolloutBox,
    h("h2", {}, "Replay"),
    h("p", {}, "Replays through POST /v1/replay (nothing is recorded). ", groupSelect, " ", replayButton),
    replayBox,
    h("h2", {}, "Groups"),
    table(["group", "index", "samples", "sample ids"], detail.samples.groups.map((g) =>
      h("tr", {}, h("td", {}, g.semantic_group || ""), h("td", { class: "num" }, fmt(g.group_index)), h("td", { class: "num" }, g.num_samples), h("td", { class: "mono" }, g.sample_ids.join(" "))),
    ), { id: "groups" }),
    h("h2", {}, "Micro-batches"),
    table(["micro-batch", "rank", "samples"], detail.samples.micro_batches.map((m) =>
      h("tr", {}, h("td", {}, m.micro_batch_id || "-"), h("td", { class: "num" }, fmt(m.rank)), h("td", { class: "num" }, m.num_samples)),
    ), { id: "micro-batches" }),
    h("h2", {}, "Payloads"),
    detail.bundles.map((b) =>
      h("div", {},
        h("p", { class: "mono" }, b.key, b.rank === null ? "" : ` (rank ${b.rank})`),
        table(["payload", "dtype", "shape", "bytes", "download"], b.payloads.map((p) =>
          h("tr", { "data-payload": p.name },
            h("td", {}, p.name), h("td", {}, p.dtype || ""), h("td", {}, (p.shape || []).join(" x ")),
            h("td", { class: "num" }, bytes(p.logical_bytes)),
            h("td", {}, downloadLink(`${p.url}?format=npy`, ".npy", `${p.name}.npy`), " ", downloadLink(`${p.url}?format=pt`, ".pt", `${p.name}.pt`)),
          ),
        ), { class: "payloads" }),
      ),
    ),
  );

  stepMismatch(run, detail, params, mismatchBox).catch((error) => showError(mismatchBox, error));

  api(`/v1/runs/${enc(run)}/steps/${enc(ref)}/result${suffix}`)
    .then((found) => {
      const r = found.result;
      fill(verdictBox, 
        h("p", { "data-status": r.status }, badge(r.status), r.first_divergent_stage ? ` first divergent stage ${r.first_divergent_stage}` : "",
          r.root_bundle_key ? ` (rooted in ${r.root_bundle_key})` : "", h("span", { class: "muted" }, ` recorded ${r.recorded_at || "?"} by trajstore ${r.trajstore_version || "?"}`)),
        stagesTable(found.stages),
        h("h3", {}, "Divergences"),
        found.divergences.length
          ? divergenceTable(found.divergences, { id: "divergences" })
          : h("p", { class: "muted", id: "divergences" }, "none recorded"),
        found.divergences_truncated ? h("p", { class: "muted" }, `first ${found.divergences.length} shown`) : null,
      );
    })
    .catch((error) => {
      if (error.status === 404) fill(verdictBox, h("p", { class: "muted", "data-status": "unreplayed" }, "no replay recorded for this step yet; use the replay button below"));
      else showError(verdictBox, error);
    });

  if (!detail.rollout_bundle_keys.length) {
    fill(rolloutBox, h("p", { class: "muted" }, "the store holds no rollout-level bundle for this rollout"));
  } else {
    Promise.all(detail.rollout_bundle_keys.map((key) => api(`/v1/bundles/${key.split("/").map(enc).join("/")}`)))
      .then((bundles) =>
        fill(rolloutBox, ...bundles.map((b) => {
          const v = b.latest_verdict;
          return h("p", { class: "mono", "data-key": b.bundle.key }, b.bundle.key, " ", badge(v ? v.status : null),
            v && v.first_divergent_stage ? ` first divergent stage ${v.first_divergent_stage}` : "",
            ` ${b.samples.num_samples} samples, ${b.payloads.length} payloads`);
        })),
      )
      .catch((error) => showError(rolloutBox, error));
  }
}

// -- Training-inference mismatch of a run ---------------------------------------------

const MISMATCH_DEFAULT = "route_mismatch_rate";

function stepRef(row) {
  return row.kind === "rollout" ? `rollout-${row.rollout_id}` : `${row.rollout_id}:${row.step_id}`;
}

// The step page of a mismatch row, pointing at its worst token (sample and offset).
function worstHref(run, row, metric) {
  const q = new URLSearchParams({ mismatch: metric });
  if (row.worst) {
    q.set("sample", row.worst.sample_id);
    q.set("offset", String(row.worst.offset));
  }
  return `/runs/${enc(run)}/steps/${stepRef(row)}?${q}`;
}

async function allMismatch(run, query) {
  const rows = [];
  let cursor = null;
  do {
    const q = new URLSearchParams(query);
    q.set("limit", "1000");
    if (cursor) q.set("cursor", cursor);
    const page = await api(`/v1/runs/${enc(run)}/mismatch?${q}`);
    rows.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor && rows.length < 20000);
  return rows;
}

// The heat map's columns: one a step while they fit at HEAT_CELL_PX each, else each
// column sums consecutive steps (the server bins them) and a click on it zooms in.
const HEAT_CELL_PX = 2;
const HEAT_MARGIN_PX = 62;

// A heat-map column's step, or its first..last step when it sums several.
function heatLabel(column) {
  const { first, last, steps } = column;
  return steps > 1 ? `${stepRef(first)}..${stepRef(last)}` : stepRef(first);
}

async function mismatchPage(run) {
  document.title = `trajstore: ${run} mismatch`;
  const params = new URLSearchParams(location.search);
  const metric = params.get("metric") || MISMATCH_DEFAULT;
  const range = {};
  if (params.get("from")) range.rollout_from = params.get("from");
  if (params.get("to")) range.rollout_to = params.get("to");
  const width = Math.min(Math.max(document.getElementById("main").clientWidth - 40, 300), 1200);
  const bins = params.get("bins") || String(Math.max(1, Math.floor((width - HEAT_MARGIN_PX) / HEAT_CELL_PX)));
  const heatData = await api(`/v1/runs/${enc(run)}/mismatch/layers?${new URLSearchParams({ ...range, bins })}`);
  const chartBox = h("div", { id: "mismatch-chart" }, h("span", { class: "muted" }, "loading"));
  const heatBox = h("div", { id: "mismatch-heat" });
  const tbody = h("tbody", {});
  const picker = h(
    "form",
    { class: "filters", id: "mismatch-form", method: "get" },
    h("label", {}, "metric", h("select", { name: "metric", id: "mismatch-metric" }, heatData.metrics.map((name) =>
      h("option", { value: name, selected: name === metric }, name),
    ))),
    ...Object.entries({ from: params.get("from"), to: params.get("to"), bins: params.get("bins") })
      .filter(([, value]) => value)
      .map(([name, value]) => h("input", { type: "hidden", name, value })),
    h("button", { type: "submit" }, "show"),
  );
  const ranged = range.rollout_from !== undefined || range.rollout_to !== undefined;
  const whole = new URLSearchParams({ metric });
  if (params.get("bins")) whole.set("bins", params.get("bins"));
  render(
    h("p", {}, h("a", { href: "/" }, "runs"), " / ", h("a", { href: `/runs/${enc(run)}` }, run), " / mismatch"),
    h("h1", {}, `Training-inference mismatch of ${run}`),
    ranged
      ? h("p", { id: "mismatch-range" }, `rollouts ${range.rollout_from ?? "first"} to ${range.rollout_to ?? "last"}; `,
        h("a", { href: `/runs/${enc(run)}/mismatch?${whole}` }, "the whole run"))
      : "",
    picker,
    h("p", { class: "muted" }, "each point is a step (all ranks); click one to open the step at its worst token; a null step is a gap"),
    chartBox,
    h("h2", {}, "Route mismatch per layer"),
    heatData.bin_steps > 1
      ? h("p", { class: "muted", id: "mismatch-heat-bins" },
        `${heatData.steps} steps, each column sums ${heatData.bin_steps} of them (the rate of the column's summed counts); click a column to zoom in`)
      : "",
    heatBox,
    h("h2", {}, "Steps"),
    table([ "step", metric, "tokens", "worst token", "reason"], tbody, { id: "mismatch-steps" }),
  );
  const columns = heatData.columns || [];
  const heatItems = heatData.items.map((c) => columns.length
    ? Object.assign({}, c, columns[c.column], { step: heatLabel(columns[c.column]) })
    : Object.assign({}, c, { step: stepRef(c), first: c, steps: 1 }));
  fill(heatBox, Charts.heat(heatItems, {
    width,
    onPick: (c) => {
      if (c.steps > 1) {
        const zoom = new URLSearchParams({ metric, from: c.first.rollout_id, to: c.last.rollout_id });
        if (params.get("bins")) zoom.set("bins", params.get("bins"));
        location.href = `/runs/${enc(run)}/mismatch?${zoom}`;
      } else {
        location.href = `/runs/${enc(run)}/steps/${stepRef(c.first)}?mismatch=route_mismatch_rate`;
      }
    },
  }));
  const rows = await allMismatch(run, { ...range, metric });
  const points = rows.map((row, i) => ({ x: i, y: row.value, label: stepRef(row), row }));
  fill(chartBox, Charts.lines([{ name: metric, points }], {
    width,
    height: 260,
    metric,
    xLabels: points.map((p) => p.label),
    onPick: (p) => { location.href = worstHref(run, p.row, metric); },
  }));
  fill(tbody, rows.map((row) =>
    h("tr", { "data-step": stepRef(row) },
      h("td", {}, h("a", { href: worstHref(run, row, metric) }, stepRef(row))),
      h("td", { class: "num" }, fmt(row.value)),
      h("td", { class: "num" }, fmt(row.tokens)),
      h("td", { class: "mono" }, row.worst ? `${row.worst.sample_id} @${row.worst.offset} (${row.worst.pair}) ${fmt(row.worst.rollout)} -> ${fmt(row.worst.trainer)}` : ""),
      h("td", { class: "muted" }, row.reason || ""),
    ),
  ));
  document.getElementById("mismatch-chart").setAttribute("data-loaded", "true");
}

// The step page's mismatch box: the step's value of the metric and its worst token.
async function stepMismatch(run, detail, params, box) {
  const metric = params.get("mismatch") || MISMATCH_DEFAULT;
  const q = new URLSearchParams({ metric, rollout_from: detail.rollout_id, rollout_to: detail.rollout_id });
  const page = await api(`/v1/runs/${enc(run)}/mismatch?${q}`);
  const row = page.items.find((r) => r.kind === "step" && r.step_id === detail.step_id);
  if (!row) {
    fill(box, h("p", { class: "muted" }, "no mismatch measured for this step"));
    return;
  }
  const w = row.worst;
  const wanted = params.get("sample");
  fill(box,
    h("p", {}, `${metric} = ${fmt(row.value)} over ${fmt(row.tokens)}`, row.reason ? ` (null: ${row.reason})` : ""),
    w ? h("dl", {
      class: `ident${wanted === w.sample_id ? " highlight" : ""}`,
      id: "worst-token",
      "data-sample": w.sample_id,
      "data-offset": w.offset,
      "data-bundle": w.bundle_key,
    },
    h("dt", {}, "worst token"), h("dd", {}, `sample ${w.sample_id}, response token ${w.offset} (${w.pair} vs rollout)`),
    h("dt", {}, "log p"), h("dd", { class: "mono" }, `rollout ${w.rollout}, trainer ${w.trainer} (|diff| ${fmt(w.abs_dlogp)})`),
    h("dt", {}, "bundle"), h("dd", { class: "mono" }, w.bundle_key),
    ) : h("p", { class: "muted" }, "no log-prob pair measured: no worst token"),
  );
  if (wanted) box.scrollIntoView();
}

// -- Routes --------------------------------------------------------------------------

async function routesPage() {
  document.title = "trajstore: routes";
  const params = new URLSearchParams(location.search);
  const chosen = params.getAll("run");
  const runs = (await api("/v1/runs")).items;
  const picker = h(
    "form",
    { class: "filters", method: "get", id: "routes-form" },
    runs.map((run) => h("label", {}, h("input", { type: "checkbox", name: "run", value: run.run, checked: chosen.includes(run.run) }), run.run)),
    h("button", { type: "submit" }, "compare"),
  );
  const out = h("div", { id: "routes" });
  render(h("h1", {}, "Route consistency"), picker, out);
  if (chosen.length < 2) {
    fill(out, h("p", { class: "muted" }, "Pick two or more runs (ratios are each run over the last one, as in `trajstore router compare`)."));
    return;
  }
  const cursors = [null];
  let page = 0;
  const load = async () => {
    const q = new URLSearchParams();
    for (const run of chosen) q.append("run", run);
    q.set("limit", "200");
    if (cursors[page]) q.set("cursor", cursors[page]);
    fill(out, h("p", { class: "muted" }, "recomputing from the stored payloads"));
    let cmp;
    try {
      cmp = await api(`/v1/router/compare?${q}`);
    } catch (error) {
      showError(out, error);
      return;
    }
    cursors[page + 1] = cmp.next_cursor;
    const labels = cmp.steps.map((s) => `${s.rollout_id}:${s.step_id}`);
    const charts = ROUTE_METRICS.map(([metric, title]) => {
      const series = cmp.runs.map((run) => ({
        name: run,
        points: cmp.steps.map((s, i) => ({ x: i, y: s.runs[run] ? s.runs[run][metric] : null, label: labels[i] })),
      }));
      return h("figure", { "data-metric": metric }, h("figcaption", {}, title), Charts.lines(series, { metric, xLabels: labels }));
    });
    const stability = cmp.stability;
    const stabilityKeys = ["steps", "missing_steps", "metric_error_steps", "hang_count", "engine_error_count", "recorded_disagreements"];
    const prev = h("button", { type: "button", disabled: page === 0 }, "previous steps");
    const next = h("button", { type: "button", disabled: !cmp.next_cursor }, "next steps");
    prev.addEventListener("click", () => { page -= 1; load(); });
    next.addEventListener("click", () => { page += 1; load(); });
    const last = cmp.baseline_of_ratios;
    fill(out, 
      h("p", { class: "muted" }, `${cmp.steps.length} step(s) ${labels[0] || ""} to ${labels[labels.length - 1] || ""}, recomputed from the stored route and log-prob payloads`),
      h("div", { class: "charts", id: "route-charts" }, charts),
      h("div", { class: "pager" }, prev, next),
      h("h2", {}, "Stability"),
      table(["run", ...stabilityKeys, "modes"], cmp.runs.map((run) =>
        h("tr", { "data-run": run }, h("td", {}, run), stabilityKeys.map((k) => h("td", { class: "num", "data-field": k }, fmt(stability[run][k]))), h("td", {}, (stability[run].modes || []).join(", "))),
      ), { id: "stability" }),
      h("h2", {}, `Ratios to ${last} (min-max over steps)`),
      table(["metric", "run", "min", "max", "steps", `${last} = 0 < run`, "both 0", "unmeasured"],
        Object.entries(cmp.ratios).flatMap(([metric, byRun]) => Object.entries(byRun).map(([run, r]) =>
          h("tr", {}, h("td", {}, metric), h("td", {}, `${run}/${last}`), h("td", { class: "num" }, fmt(r.min)), h("td", { class: "num" }, fmt(r.max)),
            h("td", { class: "num" }, r.steps), h("td", { class: "num" }, r.last_zero_steps), h("td", { class: "num" }, r.both_zero_steps), h("td", { class: "num" }, r.unmeasured_steps)),
        )), { id: "ratios" }),
      h("h2", {}, "Per step"),
      table(["step", "run", ...cmp.columns, "metric_error"], cmp.steps.flatMap((s, i) => cmp.runs.map((run) => {
        const row = s.runs[run];
        return h("tr", {}, h("td", {}, labels[i]), h("td", {}, run), cmp.columns.map((c) => h("td", { class: "num" }, row ? fmt(row[c]) : "missing")), h("td", {}, row ? row.metric_error.join(",") || "-" : "-"));
      })), { id: "route-steps" }),
    );
  };
  await load();
}

// -- Diff ----------------------------------------------------------------------------

function value(v) {
  if (v === null || v === undefined) return "";
  return typeof v === "object" ? JSON.stringify(v) : fmt(v);
}

async function diffPage() {
  document.title = "trajstore: diff";
  const params = new URLSearchParams(location.search);
  const a = params.get("a") || "";
  const b = params.get("b") || "";
  const out = h("div", { id: "diff" });
  render(
    h("h1", {}, "Diff"),
    h(
      "form",
      { class: "filters", method: "get", id: "diff-form" },
      h("label", {}, "a", h("input", { name: "a", value: a, size: 40, placeholder: "RUN/R:S[@ATTEMPT] or bundle key" })),
      h("label", {}, "b", h("input", { name: "b", value: b, size: 40, placeholder: "RUN/R:S[@ATTEMPT] or bundle key" })),
      h("button", { type: "submit" }, "diff"),
    ),
    h("p", { class: "muted" }, "Each side is RUN/R:S[@ATTEMPT], RUN/rollout-R[@ATTEMPT] or a bundle key, as for `trajstore diff --store`."),
    out,
  );
  if (!a || !b) return;
  let result;
  try {
    result = await api(`/v1/diff?a=${enc(a)}&b=${enc(b)}`);
  } catch (error) {
    showError(out, error);
    return;
  }
  out.setAttribute("data-same", String(result.same));
  fill(out, ...result.reports.map((report) => {
    const first = report.first_payload_difference;
    return h(
      "section",
      { class: "diff-report" },
      h("h2", {}, `${report.a} vs ${report.b}: `, report.same ? "identical" : `${report.differences.length} difference(s)`),
      first
        ? h("div", { class: "first-diff", id: "first-payload-difference", "data-payload": first.what, "data-sample": first.sample_id || "", "data-token": first.token_offset === null ? "" : first.token_offset },
          h("strong", {}, "first differing payload: "), first.sample_id
            ? `${first.what}, sample ${first.sample_id}, token ${first.token_offset === null ? "-" : first.token_offset}: a = ${value(first.a)}, b = ${value(first.b)}`
            : `${first.what}: ${first.detail}`)
        : h("p", { class: "muted" }, "no payload differs"),
      report.differences.length
        ? table(["kind", "what", "sample", "token", `a: ${report.a}`, `b: ${report.b}`, "detail"], report.differences.map((d) =>
          h("tr", { "data-kind": d.kind }, h("td", {}, d.kind), h("td", {}, d.what), h("td", {}, d.sample_id || ""), h("td", { class: "num" }, d.token_offset === null ? "" : d.token_offset),
            h("td", { class: "mono" }, value(d.a)), h("td", { class: "mono" }, value(d.b)), h("td", {}, d.detail)),
        ), { class: "differences" })
        : null,
    );
  }));
}

// -- router ----------------------------------------------------------------------------

async function route() {
  document.getElementById("forget-token").hidden = !sessionStorage.getItem(TOKEN_KEY);
  document.getElementById("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload();
  });
  const path = location.pathname;
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  try {
    if (parts.length === 0) await runsPage();
    else if (parts[0] === "runs" && parts.length === 2) await stepsPage(parts[1]);
    else if (parts[0] === "runs" && parts.length === 3 && parts[2] === "mismatch") await mismatchPage(parts[1]);
    else if (parts[0] === "runs" && parts.length === 4 && parts[2] === "steps") await stepPage(parts[1], parts[3]);
    else if (parts[0] === "routes") await routesPage();
    else if (parts[0] === "diff") await diffPage();
    else render(h("p", { class: "error" }, `no page at ${path}`));
  } catch (error) {
    showError(document.getElementById("main"), error);
  }
  document.body.setAttribute("data-ready", "true");
}

route();
